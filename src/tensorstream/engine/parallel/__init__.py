"""Tensor parallelism for the native Llama family over ``torch.distributed``.

``launch`` starts the ranks (spawn or torchrun) and loads each rank's part,
``weights`` chooses a rank file or slices of one file, ``plan`` holds the TP plan
and the all-reduce hooks, ``runtime`` the rank loop and failure handling, ``files``
the ``tensorize -tp N`` writer. See docs/parallel.md.
"""
