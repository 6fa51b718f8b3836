"""The steps of one bucket's reduction by the top-k hook that every wire shares.

:func:`sparsecomm.hooks.topk.topk_hook` runs the numbered steps of its docstring; each
reads the :class:`~sparsecomm.hooks.pipeline.steps.BucketCall` that the plan made:

1. ``plan``            k; the bucket's wire (:mod:`sparsecomm.hooks.wires`), or dense; dtypes
2. ``acc``             acc = grad / world_size (+ clipping, momentum) + residual
3. ``wire.encode``     select entries of acc and encode them into the wire's payload
4. ``record``          the memories after encoding (velocity masking, audit, accounting)
5. ``wire.exchange``   the wire's collectives, issued in the hook body, in bucket order
6. ``wire.accumulate`` decode what arrives into the bucket (in the Future's callback)

Also here: ``exchange_choice`` (``exchange="auto"``: the wire with the fewest modelled
seconds) and ``integrity`` (``wire_checksum``: seal, check, agree). Kernels may fuse
steps (the fused error feedback + top-k + pack kernel forms acc itself, so step 2 is
skipped); every kernel has a pure-torch reference twin (``sparsecomm.ops.reference``,
``sparsecomm.compress``). Rules: collectives only from the hook body (steps 1-5), never
from a Future callback (step 6), where ranks would issue them in different orders.
"""
