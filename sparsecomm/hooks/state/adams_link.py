"""The shared mask's link to the job's AdamS (``exchange="shared-mask"``).

SCAPE's reducer synchronises the optimizer's first moment: the hook reads AdamS's ``exp_avg``
of each bucket (the same on every rank) to form the corrected momentum, and after the
exchange tells AdamS which entries the step's mask holds, so that AdamS zeroes its moment
off the mask and moves parameters only on it (:mod:`sparsecomm.hooks.wires.shared_mask`).
"""
import torch


class AdamSLink:
    """Which AdamS the hook reads, by parameter name, and the masks of the step it last reduced."""

    __slots__ = ("optimizer", "by_name", "applied", "step")

    def __init__(self):
        self.optimizer = None
        self.by_name: dict[str, tuple[torch.nn.Parameter, dict]] = {}
        self.applied: dict[int, torch.Tensor] = {}  # id(parameter) -> bool mask of the step ``self.step``
        self.step = None

    @property
    def attached(self) -> bool:
        return self.optimizer is not None

    def attach(self, optimizer, names_by_id: dict[int, str]) -> None:
        """Read ``optimizer``'s first moment (a :class:`sparsecomm.optim.AdamS` holding the bound
        model's parameters) and hand it each step's masks. TypeError/ValueError otherwise."""
        # AdamS by what it offers (``sparsecomm.optim`` sits above this floor):
        if not callable(getattr(optimizer, "follow_masks", None)) or not hasattr(optimizer, "param_groups"):
            raise TypeError(f"exchange='shared-mask' synchronises AdamS's first moment: optimizer must be a "
                            f"sparsecomm.optim.AdamS, got {type(optimizer).__name__}")
        by_name = {}
        for group in optimizer.param_groups:
            for param in group["params"]:
                name = names_by_id.get(id(param))
                if name is not None:
                    by_name[name] = (param, group)
        missing = sorted(set(names_by_id.values()) - set(by_name))
        if missing:
            raise ValueError(f"exchange='shared-mask': the optimizer does not hold {len(missing)} of the model's "
                             f"parameters (first: {missing[:3]}); build AdamS over the model's parameters")
        self.optimizer, self.by_name = optimizer, by_name
        optimizer.follow_masks(self)

    def read(self, names, numels, like: torch.Tensor) -> tuple[torch.Tensor, float | torch.Tensor]:
        """(the bucket's ``exp_avg`` flat in ``like``'s dtype, zeros before AdamS's first step;
        beta1, a float, or per entry where the tensors' param groups differ)."""
        previous = torch.zeros_like(like)
        betas = []
        for name, part in zip(names, previous.split(list(numels))):
            param, group = self.by_name[name]
            state = self.optimizer.state.get(param)
            if state and "exp_avg" in state:
                part.copy_(state["exp_avg"].reshape(-1))
            betas.append(float(group["betas"][0]))
        if len(set(betas)) == 1:
            return previous, betas[0]
        counts = torch.tensor(list(numels), device=like.device)
        return previous, torch.repeat_interleave(torch.tensor(betas, dtype=like.dtype, device=like.device), counts)

    def set_applied(self, names, numels, mask: torch.Tensor, step: int) -> None:
        """The mask (bool, flat over the bucket) that step ``step`` applied to these tensors."""
        if step != self.step:
            self.applied, self.step = {}, step
        for name, part in zip(names, mask.split(list(numels))):
            param, _ = self.by_name[name]
            self.applied[id(param)] = part.view_as(param)

    def mask_of(self, param: torch.Tensor) -> torch.Tensor | None:
        """AdamS asks: the mask of ``param`` in the step just reduced (None: no mask, a dense step)."""
        return self.applied.get(id(param))

    def forget(self) -> None:
        """A step without a sparse reduction (warm-up): AdamS steps every entry."""
        self.applied, self.step = {}, None
