"""The wires: one class per way a sparse bucket travels between the ranks.

=========================  ===========================================================  ==================
wire                       when                                                         received per rank
=========================  ===========================================================  ==================
``AllgatherWire``          ``exchange="allgather"`` (default): exact top-k (int32 +     (p-1) payloads
                           float), the sampled threshold, chunked top-k, or exact
                           top-k on the compact wire (index and value codecs)
``VariableAllgatherWire``  ``transport="mpi"`` + ``selector="sampled"``: each rank      what the others
                           sends its own count of entries (MPI ``Iallgatherv``)          sent
``OwnerWire``              ``exchange="owner"``: owners of ranges sum and re-select      ~2 (p-1)/p payload
``SharedIndexWire``        ``exchange="shared-index"``: a rotating leader's index set,   ~2 k values + the
                           every rank's values there allreduced                          index set
``SharedMaskWire``         ``exchange="shared-mask"``: SCAPE's reducer under AdamS, the  ~2 k values + a
                           owners' per-tensor mask of the step before, values          bitmap of the
                           allreduced                                                  bucket
``RandomKWire``            ``selector="random"``: indices from a shared seeded stream,   ~2 k values
                           values allreduced
``DenseWire``              warm-up, the dense fallback, or ``exchange="auto"``'s choice  ~2 x the bucket
=========================  ===========================================================  ==================

Each wire owns its layout, its buffers, its byte counts, its encode, exchange and decode
(``base.Wire``), and its modelled seconds on a link, which ``exchange="auto"`` compares. Which
wire a bucket takes, with which layout, is the plan's to say (``pipeline.steps.build``); the
hook keeps one per bucket (``pipeline.steps.PlanCache``) and reuses it, with its buffers, while
the bucket's layout holds. The averager runs the same wires.
"""
from sparsecomm.hooks.wires.allgather import AllgatherWire
from sparsecomm.hooks.wires.base import Packed, Wire
from sparsecomm.hooks.wires.dense import DenseWire
from sparsecomm.hooks.wires.owner import OwnerWire
from sparsecomm.hooks.wires.shared_index import RandomKWire, SharedIndexWire
from sparsecomm.hooks.wires.shared_mask import SharedMaskWire
from sparsecomm.hooks.wires.variable_allgather import VariableAllgatherWire

__all__ = ["AllgatherWire", "DenseWire", "OwnerWire", "Packed", "RandomKWire", "SharedIndexWire",
           "SharedMaskWire", "VariableAllgatherWire", "Wire"]
