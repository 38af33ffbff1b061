"""Issue 19 item 13: MtpProposer refuses bad constructor arguments up front, each a
ProposerArgumentError naming the argument (before anything is compiled or allocated)."""
import math

import pytest
import torch

from draft_circuit.circuit.layers.mtp import MtpHead
from draft_circuit.runners.proposer import MtpProposer
from draft_circuit.runners.proposer_args import ProposerArgumentError
from draft_circuit.runners.proposer_state import ProposerError
from draft_circuit.runners.testing import random_mtp_weights
from tests.runners.tiny_chain import tiny_config

CFG = tiny_config(vocab_size=90)
HEAD = MtpHead(CFG)
PARAMS = HEAD.bind(random_mtp_weights(CFG, seed=11))
GOOD = dict(num_drafts=3, num_blocks=40, block_size=8, max_blocks_per_seq=6, max_width=4,
            widths=(1, 2, 4), forward="eager")

@pytest.mark.parametrize("argument,value,message", [
    ("num_drafts", 0, "must be >= 1, got 0"),
    ("num_drafts", 2.0, "must be an int, got 2.0"),
    ("num_drafts", True, "must be an int"),
    ("num_blocks", 1, "must be >= 2, got 1"),
    ("num_blocks", "40", "must be an int, got '40'"),
    ("block_size", 0, "must be >= 1"),
    ("max_blocks_per_seq", -1, "must be >= 1"),
    ("max_blocks_per_seq", 0, "must be >= 1"),
    ("max_width", 0, "must be >= 1"),
    ("widths", "1,2", "must be a sequence of ints"),
    ("widths", (1, 0), "must be >= 1, got 0"),
    ("widths", (1, 2.5), "must be an int, got 2.5"),
    ("device", "banana", "'banana' is not a torch device"),
    ("kv_exact", 1, "must be True or False"),
    ("refeed", "no", "must be True or False"),
    ("draft_confidence_stop", 1.5, "must be None or a number in (0, 1) exclusive, got 1.5"),
    ("draft_confidence_stop", math.nan, "in (0, 1) exclusive"),
    ("draft_confidence_stop", "0.5", "in (0, 1) exclusive"),
    ("factory", "circuit", "must be callable"),
])
def test_bad_argument_is_named(argument, value, message):
    with pytest.raises(ProposerArgumentError, match=rf"MtpProposer\({argument}=\.\.\.\): .*"
                                                    rf"{message.replace('(', '.').replace(')', '.')}") as e:
        MtpProposer(HEAD, PARAMS, **{**GOOD, argument: value})
    assert e.value.argument == argument and isinstance(e.value, ProposerError)

def test_a_table_too_small_for_the_chain():
    with pytest.raises(ProposerArgumentError, match="max_blocks_per_seq=.*hold 4 drafter rows per "
                                                    "sequence; a chain of num_drafts=4 needs more"):
        MtpProposer(HEAD, PARAMS, **{**GOOD, "num_drafts": 4, "block_size": 2,
                                     "max_blocks_per_seq": 2})

def test_bad_head_and_params():
    with pytest.raises(ProposerArgumentError, match=r"\(head=\.\.\.\): must be a draft head"):
        MtpProposer(object(), PARAMS, **GOOD)
    with pytest.raises(ProposerArgumentError, match=r"\(params=\.\.\.\): must be a mapping"):
        MtpProposer(HEAD, list(PARAMS.items()), **GOOD)
    name = next(iter(PARAMS))
    with pytest.raises(ProposerArgumentError, match=f"{name!r} is a list, not a tensor"):
        MtpProposer(HEAD, {**PARAMS, name: [1.0]}, **GOOD)

@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without a usable CUDA device")
def test_cuda_without_cuda():
    with pytest.raises(ProposerArgumentError, match="no usable CUDA device"):
        MtpProposer(HEAD, PARAMS, **{**GOOD, "device": "cuda"})

def test_good_arguments_still_build_and_widths_past_max_width_are_dropped():
    p = MtpProposer(HEAD, PARAMS, **{**GOOD, "widths": (1, 2, 4, 8, 16)})
    assert p.widths == (1, 2, 4)
