"""What a recipe is and the model it makes: every TransformerConfig field's role, the recipe's
configs, the GPTModel or HybridModel built from Megatron-LM's layer specs and checked against the
recipe's structure fields, the names ttrace gives its modules and parameters, the tokens it trains
on, and what differs between the supported megatron-core releases."""
