"""Intra-node parallelism applied to a plain ``GPT`` from outside: tensor (``tensor``) and pipeline (``pipeline``)."""
