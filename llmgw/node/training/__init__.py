"""LoRA fine-tuning on a node (issue 17): the node-side toolkit the agent runs training jobs with.

The pairs file's format and checks are :mod:`llmgw.training_pairs` (neutral: ``ctl`` and the
control plane check a file with it before it is sent; the trainer loads it by path).

- :mod:`llmgw.node.training.overlay`: peft and accelerate, installed once from a
  hash-pinned lock as an overlay directory the vLLM environment's python imports from.
- :mod:`llmgw.node.training.trainer`: the training script, run by the vLLM environment's
  python with the overlay on ``PYTHONPATH``; JSON events on stdout.
- :mod:`llmgw.node.training.run`: :func:`~llmgw.node.training.run.run_trainer`, which
  runs that script under trio in its own process group and turns its events into calls.
- :mod:`llmgw.node.training.gguf`: a trained adapter converted to GGUF for llama.cpp with
  the llama.cpp sdist's own converter.
"""
