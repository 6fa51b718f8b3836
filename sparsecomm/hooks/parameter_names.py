"""The names that key the hook's memories: a bound module's parameter names, or, unbound,
``param0``, ``param1``, ... in the order the hook first sees the parameters."""
import torch
import torch.distributed as dist


class ParameterNames:
    """Which name every parameter of this process has (by ``id``: ids belong to the process,
    so a pickle keeps only whether the names came from a module)."""

    __slots__ = ("by_id", "shapes", "module_id", "from_module")

    def __init__(self):
        self.by_id: dict[int, str] = {}  # id(parameter) -> name
        self.shapes: dict[str, tuple[int, torch.dtype]] = {}  # name -> (numel, dtype) of the bound module's
        self.module_id: int | None = None  # id of the module the names came from, None if unbound
        self.from_module = False  # True once names came from a module (an unpickled state must be re-bound)

    def bind(self, inner: torch.nn.Module) -> None:
        """Take the names of ``inner`` (the module a DDP model wraps)."""
        self.module_id = id(inner)
        self.from_module = True
        self.by_id = {id(p): name for name, p in inner.named_parameters()}
        self.shapes = {name: (p.numel(), p.dtype) for name, p in inner.named_parameters()}

    def bind_placeholders(self, owner: torch.nn.Module, placeholders: dict[str, tuple[torch.Tensor, torch.dtype]]) -> None:
        """Name buffers that are not parameters (FSDP2's per-module shard buffers,
        :mod:`sparsecomm.fsdp`): each is stood for by a placeholder tensor of its size, which
        the bucket lists as its one parameter; ``owner`` is the model they belong to."""
        if self.module_id is not None or self.by_id:
            raise ValueError("this TopKState is already bound to a module or has run: use a new TopKState")
        self.module_id = id(owner)
        self.from_module = True
        self.by_id = {id(tensor): name for name, (tensor, _) in placeholders.items()}
        self.shapes = {name: (tensor.numel(), dtype) for name, (tensor, dtype) in placeholders.items()}

    def forget_process(self) -> None:
        """What a pickle keeps: ids and the module belong to this process."""
        self.by_id, self.module_id = {}, None

    def of_bucket(self, bucket: dist.GradBucket) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """(names, numels) of the bucket's parameters, in bucket order."""
        names, numels = [], []
        for param in bucket.parameters():
            name = self.by_id.get(id(param))
            if name is None:
                if self.module_id is not None:
                    raise ValueError(
                        "the hook saw a parameter that is not in the module bound to this "
                        "TopKState: register the state on the DDP model it was bound to"
                    )
                if self.from_module:
                    raise ValueError(
                        "this TopKState was unpickled (or copied) from a state bound to a model: bind it to "
                        "this process's model first, with state.bind(ddp_model) or "
                        "sparsecomm.register_topk_hook(ddp_model, state), so its residuals find their parameters"
                    )
                name = self.by_id[id(param)] = f"param{len(self.by_id)}"
            names.append(name)
            numels.append(param.numel())
        return tuple(names), tuple(numels)
