"""The FSDP2 models the FSDP tests train: a (replicate, shard) mesh, a small model whose
blocks and root are fully_shard-ed over mesh["shard"] (its second layer, 3 rows, does not
split evenly, so shards are padded), and a regression loss against a fixed teacher."""
import torch

STEPS = 30


def mesh_of(replicas: int, shards: int, device_type: str = "cpu"):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (replicas, shards), mesh_dim_names=("replicate", "shard"))


def model_on(shard_mesh, bf16: bool = False):
    """Two linear blocks, each fully_shard-ed, and a LayerNorm the root holds itself;
    ``bf16``: computed and reduced in bfloat16 (MixedPrecisionPolicy), stored in float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3),
                                torch.nn.LayerNorm(3))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16 else \
        MixedPrecisionPolicy()
    for block in (model[0], model[2]):
        fully_shard(block, mesh=shard_mesh, mp_policy=policy)
    fully_shard(model, mesh=shard_mesh, mp_policy=policy)
    return model


TEACHER = torch.linspace(-1.0, 1.0, 24).reshape(8, 3)  # the targets: a fixed linear map of the inputs


def loss(model, x: torch.Tensor) -> torch.Tensor:
    return (model(x) - x @ TEACHER.to(x.device)).square().mean()


def train(model, rank: int, steps: int, after_step=None, device: str = "cpu") -> list[torch.Tensor]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(100 + rank)  # every rank its own data
    for step in range(steps):
        x = torch.randn(4, 8, generator=generator).to(device)
        loss(model, x).backward()
        optimizer.step()
        optimizer.zero_grad()
        if after_step is not None:
            after_step(step)
    return [p.to_local().detach().cpu().clone() for p in model.parameters()]


def replica_check(model, mesh, disagreements: list):
    """An ``after_step`` for :func:`train`: appends (step, parameter index) wherever the replicas
    of this rank's shard do not hold the same parameters, bit for bit."""
    import torch.distributed as dist

    group = mesh.get_group("replicate")
    replicas = dist.get_world_size(group)

    def check(step):
        for index, p in enumerate(model.parameters()):
            local = p.to_local().detach().contiguous()
            copies = [torch.empty_like(local) for _ in range(replicas)]
            dist.all_gather(copies, local, group=group)
            if not all(torch.equal(copies[0], c) for c in copies[1:]):
                disagreements.append((step, index))
    return check
