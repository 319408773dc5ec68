"""The bug zoo: known numerical bugs injected into a candidate at run time, to prove that a check
catches and localizes them."""
