"""The ``--ttrace*`` flags on Megatron-LM's argument parser, chained after the provider it has.

:class:`..run.session.TraceOptions` reads them back (``TraceOptions.from_args``).
"""

from __future__ import annotations

import argparse
from typing import Callable, List, Optional

from ...recipe import SEED_INIT_MEGATRON, SEED_INITS
from ...trace_store import CANDIDATE, REFERENCE


def parse_int_ranges(text: str) -> List[int]:
    """``"1,3-5"`` → ``[1, 3, 4, 5]`` (non-negative integers)."""
    out: List[int] = []
    try:
        for part in (p.strip() for p in text.split(",")):
            if "-" in part:
                lo, hi = part.split("-", 1)
                out.extend(range(int(lo), int(hi) + 1))
            elif part:
                out.append(int(part))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers and ranges like 1,3-5, got {text!r}") from None
    return out


# every --ttrace* flag, as argparse takes it; TraceOptions.from_args reads each back
FLAGS = (
    ("--ttrace", dict(action="store_true", help="record tensors for ttrace (off: ttrace does nothing)")),
    ("--ttrace-dir", dict(default="ttrace", help="trace directory (default: ./ttrace)")),
    ("--ttrace-iters", dict(type=parse_int_ranges, help="record only these iterations (1-based), e.g. 1,3-5")),
    ("--ttrace-modules", dict(
        action="append", metavar="PATTERN",
        help="record only modules matching this fnmatch pattern (repeatable), e.g. 'decoder.layers.1.*'")),
    ("--ttrace-ranks", dict(type=parse_int_ranges, help="record only on these global ranks")),
    ("--ttrace-microbatches", dict(type=parse_int_ranges, help="record only these global microbatch ids")),
    ("--ttrace-reference", dict(
        metavar="DIR", help="online compare: judge each rank's shards against this reference trace during the run "
                            "and write verdicts only")),
    ("--ttrace-keep-tensors", dict(action="store_true",
                                   help="with --ttrace-reference, also write the candidate's tensors")),
    ("--ttrace-seed-checkpoint", dict(
        metavar="FILE", help="start from the same logical weights: the reference writes FILE (if absent), every "
                             "other run loads its shard of each weight from it, whatever its parallel layout")),
    ("--ttrace-seed-init", dict(
        choices=SEED_INITS, default=SEED_INIT_MEGATRON,
        help="with --ttrace-seed-checkpoint, what the reference writes to it: megatron's initialization, or weights "
             "redrawn so that a layout's bugs show (O(1) activations, peaked attention, non-zero biases)")),
    ("--ttrace-replay", dict(
        metavar="DIR", help="localization replay: every recorded module runs on this reference trace's inputs and "
                            "output-grads, so each is judged on its own (then: ttrace localize REF DIR)")),
    ("--ttrace-perturb", dict(
        type=int, default=0, metavar="SEED",
        help="the perturbation estimate: run the reference again with round-off-sized noise in every recorded "
             "module (seeded by SEED > 0), into its own --ttrace-dir; ttrace compare --perturbed DIR then bounds "
             "each tensor by what this noise moves it")),
    ("--ttrace-lockstep", dict(
        metavar="DIR", help="lock-step: after each optimizer step, take this reference trace's parameters and "
                            "optimizer state, so every iteration is judged given identical weights and state "
                            "(the reference must record every iteration)")),
    ("--ttrace-page-cache", dict(
        action="store_true", help="write the trace through the page cache (no O_DIRECT, no fsync): a check that reads it "
                                  "right after on this machine (lock-step, online) reads it from memory")),
    ("--ttrace-map-reference", dict(
        action="store_true", help="with --ttrace-reference: read the reference through memory maps of its files, "
                                  "not copies; only for a reference written whole before this run and by no one "
                                  "while it runs (a file that shrinks under a map ends the run with SIGBUS)")),
    ("--ttrace-role", dict(choices=("auto", REFERENCE, CANDIDATE), default="auto",
                           help="label of this run (auto: reference when TP=PP=CP=EP=DP=1)")),
)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    if "--ttrace" in parser._option_string_actions:  # added already (a patched script run by --megatron-lm)
        return parser
    group = parser.add_argument_group("ttrace", "differential testing against a single-device reference")
    for flag, settings in FLAGS:
        group.add_argument(flag, **settings)
    return parser


def extra_args_provider(existing: Optional[Callable] = None):
    """An ``extra_args_provider`` for ``pretrain(...)`` that adds ``--ttrace*`` after ``existing``.

    Megatron-LM accepts one provider, so the existing one (modelopt's, or None) is chained. Given a
    parser instead of a provider, adds the arguments to it and returns it.
    """
    if isinstance(existing, argparse.ArgumentParser):
        return add_arguments(existing)

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if existing is not None:
            parser = existing(parser)
        return add_arguments(parser)

    return provider
