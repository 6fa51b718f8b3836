"""The stages of one bucket's reduction by the top-k hook, one file each.

:func:`sparsecomm.hooks.topk.topk_hook` calls them in order (the numbered steps of its
docstring); each reads the :class:`~sparsecomm.hooks.pipeline.plan.BucketCall` that the
plan made and hands its result to the next:

1. ``plan``          dense (warm-up, fallback) or sparse; k; dtypes; the payload layout
2. ``acc``           acc = grad / world_size (+ clipping, momentum) + residual
3. ``select_encode`` select entries of acc and encode them into the payload (kernels)
4. ``record``        the memories after packing (velocity masking, audit, accounting)
5. ``exchange``      the collective, issued here in the hook body, in bucket order
6. ``decode``        decode and accumulate what arrives into the bucket (in the callback)

``dense`` is the dense path (acc, allreduce) as a whole. Kernels may fuse stages (the
fused error feedback + top-k + pack kernel forms acc itself, so stage 2 is skipped);
every stage has a pure-torch reference twin (``sparsecomm.ops.reference``,
``sparsecomm.compress``). Rules: collectives only from the hook body (stages 1-5), never
from a Future callback (stage 6), where ranks would issue them in different orders.
"""
