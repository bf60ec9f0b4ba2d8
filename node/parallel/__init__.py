"""Intra-node parallelism applied to a plain ``GPT`` from outside: tensor (``tensor``), pipeline
(``pipeline``), ZeRO-1 / FSDP2 sharding across data-parallel ranks (``zero``), and the layout
planner behind ``dtnode plan`` (``plan``)."""
