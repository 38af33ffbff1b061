"""A small greedy speculative-decoding engine: a Llama target built from the project's ops,
its MTP head drafting through `runners.proposer`, continuous batching over paged KV.

    python -m examples.engine --forward circuit      # the embedded byte-level default

Layout (policy / mechanism / maths apart, as in nano-vllm): `engine.py` the step loop,
`scheduler.py` admission, `runner.py` sequences -> target rows, `model.py` the target circuit,
`speculate.py` drafting and acceptance, `checkpoints.py` weights and prompts, `report.py`
progress and summary, `__main__.py` the command line.
"""
from examples.engine.checkpoints import Checkpoint, EngineError, load_checkpoint
from examples.engine.engine import Engine, EngineConfig, Result
from examples.engine.sequence import Request

__all__ = ["Checkpoint", "Engine", "EngineConfig", "EngineError", "Request", "Result",
           "load_checkpoint"]
