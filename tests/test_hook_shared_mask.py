"""exchange="shared-mask": SCAPE's reducer under AdamS (sparsecomm/hooks/wires/shared_mask.py).

Oracles:

- the reducer written out here in float64 from its authors' description, with no library code
  (:func:`_scape_oracle`): the per-tensor owners (contiguous runs balanced by element count),
  the owner's per-tensor top-k of ``|beta1 m + (1 - beta1) g + e|`` used one step late (the
  first sparse step makes its own), the average of the corrected momentum at the mask, the
  residual in momentum space (corrected off the mask, no decay), ``g_hat = (s - beta1 m) /
  (1 - beta1)`` on the mask, norms and biases whole, the geometric density warm-up; fed with
  the raw local gradients the ranks' buckets held (the hook's "gradient" event);
- AdamS stepped here in float64 from the hook's own recovered gradients and masks, with its
  moment zeroed off the mask (:func:`_adams_oracle`): only the masked step is under test there;
- conservation per rank, exactly, by the hook's own audit (``verify_conservation``, which
  rebuilds the corrected momentum from copies taken before the hook touched anything);
- literal cases worked by hand for the owners, the mask sizes and the bitmaps;
- bytes against sizes worked out by hand; a resumed run against the uninterrupted one, bit
  for bit; bad settings refused by name.
"""
import math

import pytest
import torch
import torch.distributed as dist

import sparsecomm
import sparsecomm.hooks.state.memories
from ddp_models import rank_data
from rank_processes import run_on_ranks
from sparsecomm.checkpoint.bucket_rebuild import rebuild_buckets
from sparsecomm.hooks.wires.shared_mask import mask_sizes, owned_ranges, owners, pack_bits, unpack_bits
from sparsecomm.optim import AdamS

BETA1, BETA2, LR, WEIGHT_DECAY, EPS = 0.9, 0.999, 0.01, 0.01, 1e-8
DENSITY, WARMUP_STEPS, DENSITY_WARMUP = 0.2, 2, 4
U = 2.0**-24  # float32's unit roundoff


class Tiny(torch.nn.Module):
    """Names that say which tensors go whole: ``proj.bias``, ``layer_norm.*`` (norm and biases)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(6, 5)
        self.layer_norm = torch.nn.LayerNorm(5)
        self.mid = torch.nn.Linear(5, 7, bias=False)
        self.head = torch.nn.Linear(7, 4, bias=False)

    def forward(self, x):
        return self.head(torch.tanh(self.mid(torch.tanh(self.layer_norm(self.proj(x))))))


def _schedule(step: int) -> float:
    """The geometric warm-up from 1.0 (the authors' ``start x (target/start)^(t/T)``)."""
    return DENSITY ** (step / DENSITY_WARMUP) if step < DENSITY_WARMUP else DENSITY


def _train(rank, world_size, steps):
    ddp = torch.nn.parallel.DistributedDataParallel(Tiny(), bucket_cap_mb=0.0002)
    initial = {name: p.detach().clone() for name, p in ddp.module.named_parameters()}
    optimizer = AdamS(ddp.parameters(), lr=LR, betas=(BETA1, BETA2), eps=EPS, weight_decay=WEIGHT_DECAY)
    state = sparsecomm.register_topk_hook(
        ddp, density=DENSITY, exchange="shared-mask", optimizer=optimizer, warmup_steps=WARMUP_STEPS,
        density_schedule={"kind": "geometric", "steps": DENSITY_WARMUP}, verify_conservation=True)
    seen = []

    def observe(event):
        if event.stage in ("gradient", "reduced") or (event.stage == "packed" and not event.dense):
            tensor = {"gradient": "gradient", "packed": "indices", "reduced": "reduced"}[event.stage]
            seen.append((event.stage, event.step, event.bucket_index, event.names, event.numels, event.dense,
                         event.tensors[tensor].clone()))

    state.add_observer(observe)
    for x in rank_data(rank, steps, (8, 6)):
        loss = torch.nn.functional.mse_loss(ddp(x), torch.sin(x[:, :4]))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    final = {name: p.detach().clone() for name, p in ddp.module.named_parameters()}
    residuals = {name: state.memories.residuals.get(name).clone() for name in final}
    everyone = [None] * world_size
    dist.all_gather_object(everyone, seen)
    return everyone, initial, final, residuals, state.stats()


def _events(seen, stage):
    """{(step, bucket): (names, numels, dense, tensor)} of one rank's events of ``stage``."""
    return {(step, bucket): (names, numels, dense, tensor)
            for kind, step, bucket, names, numels, dense, tensor in seen if kind == stage}


def _owners(numels, world_size):
    """The authors' rule, written out again: walk the tensors, give each to the current owner;
    move to the next owner once it holds its share of the elements, as long as the tensors
    left outnumber the owners left, and whenever they no longer do."""
    share, owner, held, result = sum(numels) / world_size, 0, 0, []
    for position, numel in enumerate(numels):
        result.append(owner)
        held += numel
        left, owners_left = len(numels) - position - 1, world_size - owner - 1
        if owner < world_size - 1 and ((held >= share and left > owners_left) or left <= owners_left):
            owner, held = owner + 1, 0
    return result


def _whole(name):
    return any(part in name.lower() for part in ("layernorm", "layer_norm", "rmsnorm", "rms_norm", "bias"))


def _owner_mask(names, numels, corrected, density, world_size):
    """{name: bool mask}: each tensor's owner's top-k of |its corrected momentum|."""
    masks = {}
    for name, numel, owner in zip(names, numels, _owners(numels, world_size)):
        k = numel if density >= 1.0 or _whole(name) else max(1, int(density * numel))
        mask = torch.zeros(numel, dtype=torch.bool)
        mask[torch.topk(corrected[owner][name].abs(), k).indices] = True
        masks[name] = mask
    return masks


def _scape_oracle(gradients, world_size, steps):
    """Per (step, bucket): (the mask's flat indices or None for a dense step, g_hat, the largest
    corrected-momentum term seen so far), and the residuals at the end, per rank and name. From
    ``gradients[rank][(step, bucket)] = (names, numels, dense, local gradient)``, in float64."""
    m, e, mask, expected, scale = {}, {}, {}, {}, 0.0
    for step in range(steps):
        buckets = sorted(b for s, b in gradients[0] if s == step)
        recovered = {}
        for bucket in buckets:
            names, numels, _, _ = gradients[0][step, bucket]
            g = [dict(zip(names, gradients[r][step, bucket][3].double().split(list(numels))))
                 for r in range(world_size)]
            if step < WARMUP_STEPS:  # the hook's dense warm-up: the average gradient, AdamS steps all
                for name in names:
                    recovered[name] = sum(g[r][name] for r in range(world_size)) / world_size
                expected[step, bucket] = (None, torch.cat([recovered[n] for n in names]), scale)
                continue
            corrected = [{name: BETA1 * m.get(name, torch.zeros_like(g[r][name])) + (1 - BETA1) * g[r][name]
                          + e.get((r, name), torch.zeros_like(g[r][name])) for name in names}
                         for r in range(world_size)]
            scale = max(scale, *(float((BETA1 * m.get(n, torch.zeros(1))).abs().max() + ((1 - BETA1) * g[r][n]).abs().max()
                                       + e.get((r, n), torch.zeros(1)).abs().max())
                                 for r in range(world_size) for n in names))
            if any(name not in mask for name in names):  # the first sparse step makes its own mask
                mask.update(_owner_mask(names, numels, corrected, _schedule(step), world_size))
            used = {name: mask[name] for name in names}
            for name in names:
                synced = sum(corrected[r][name] for r in range(world_size)) / world_size
                previous = m.get(name, torch.zeros_like(synced))
                recovered[name] = torch.where(used[name], (synced - BETA1 * previous) / (1 - BETA1), 0.0)
                for r in range(world_size):
                    e[r, name] = torch.where(used[name], 0.0, corrected[r][name])
            mask.update(_owner_mask(names, numels, corrected, _schedule(step + 1), world_size))  # one step late
            flat_used = torch.cat([used[n] for n in names])
            expected[step, bucket] = (flat_used.nonzero().reshape(-1), torch.cat([recovered[n] for n in names]), scale)
            for name in names:  # AdamS's moment after its masked step: the average on the mask, 0 off it
                m[name] = torch.where(used[name], BETA1 * m.get(name, 0.0) + (1 - BETA1) * recovered[name], 0.0)
        if step < WARMUP_STEPS:
            for name, g_hat in recovered.items():
                m[name] = BETA1 * m.get(name, torch.zeros_like(g_hat)) + (1 - BETA1) * g_hat
    return expected, e


def _adams_oracle(initial, reduced, steps):
    """AdamS in float64 from the hook's own g_hat and masks (``reduced[step][name] = (g_hat,
    mask or None)``), moment zeroed off the mask before each step; the final parameters."""
    theta = {name: p.double().reshape(-1) for name, p in initial.items()}
    m = {name: torch.zeros_like(t) for name, t in theta.items()}
    for step in range(steps):
        correction = 1 - BETA1 ** (step + 1)
        for name, (g, mask) in reduced[step].items():
            if mask is not None:
                m[name] = torch.where(mask, m[name], 0.0)
            v = BETA2 * (m[name] / correction) ** 2 + (1 - BETA2) * g**2
            m[name] = BETA1 * m[name] + (1 - BETA1) * g
            update = (m[name] / correction) / (v.sqrt() + EPS)
            if mask is not None:
                update = torch.where(mask, update, 0.0)
            theta[name] = theta[name] * (1 - LR * WEIGHT_DECAY) - LR * update
    return theta


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_reducer_and_adams_follow_scape_step_by_step(world_size):
    steps = 8
    results = run_on_ranks(_train, steps, world_size=world_size, timeout=180)
    everyone, initial, _, _, stats = results[0]
    gradients = [_events(everyone[r], "gradient") for r in range(world_size)]
    expected, oracle_residuals = _scape_oracle(gradients, world_size, steps)
    reduced_by_step = {step: {} for step in range(steps)}
    sparse_checked = 0
    for (step, bucket), (mask, g_hat, scale) in sorted(expected.items()):
        names, numels, dense, reduced = _events(everyone[0], "reduced")[step, bucket]
        for r in range(1, world_size):  # every replica receives the same bits
            assert torch.equal(_events(everyone[r], "reduced")[step, bucket][3], reduced), (step, bucket, r)
        assert dense == (mask is None), (step, bucket)
        if mask is None:  # a gloo sum of p float32 gradients / p against the exact mean
            assert torch.allclose(reduced.double(), g_hat, rtol=0, atol=world_size * 4 * U * float(g_hat.abs().max()) + 1e-30)
        else:
            for r in range(world_size):  # the one-step-late mask, the same on every rank
                assert torch.equal(_events(everyone[r], "packed")[step, bucket][3], mask), (step, bucket, r)
            # Each corrected entry is 5 float32 roundings of terms <= scale; the sum adds p - 1
            # more; the memories carry what earlier steps rounded (at most as much per step);
            # 1 / (1 - beta1) = 10 amplifies it all into g_hat.
            bound = 10 * (5 + world_size) * (step + 1) * U * scale
            assert float((reduced.double() - g_hat).abs().max()) <= bound, (step, bucket)
            sparse_checked += 1
        flat_mask = None
        if mask is not None:
            flat_mask = torch.zeros(sum(numels), dtype=torch.bool)
            flat_mask[mask] = True
        for name, part, part_mask in zip(names, reduced.split(list(numels)),
                                         flat_mask.split(list(numels)) if flat_mask is not None else [None] * len(names)):
            reduced_by_step[step][name] = (part.double(), part_mask)
    assert sparse_checked >= 3 * (steps - WARMUP_STEPS) // 2
    assert stats["shared_mask_calls"] == stats["sparse_calls"] > 0 and stats["warmup_calls"] > 0
    # Parameters move only on the mask, as AdamS does from the same g_hat: float64 against the
    # ranks' float32 (a handful of roundings per step, each relative to an update <= 3.3 lr).
    theta = _adams_oracle(initial, reduced_by_step, steps)
    for _, _, final, residuals, _ in results:
        for name, value in final.items():
            assert float((value.double().reshape(-1) - theta[name]).abs().max()) <= steps * 3.3 * LR * 64 * U, name
    # Momentum-space residuals (the hook keeps them divided by p): each is corrected momentum
    # off the mask, whose roundings and carried errors the g_hat bound counts before the x10,
    # plus one rounding for the x p here; twice that bound.
    largest_term = max(scale for _, _, scale in expected.values())
    for rank, (_, _, _, residuals, _) in enumerate(results):
        for name, residual in residuals.items():
            want = oracle_residuals[rank, name]
            error = float((residual.double() * world_size - want).abs().max())
            assert error <= 2 * (5 + world_size) * steps * U * largest_term, (rank, name, error)


def test_owners_sizes_and_bitmaps_worked_by_hand():
    # 16 elements over 3 owners: a share of 5.33. The first owner takes 6 and moves on; the
    # second takes 2 and 2 (4 < 5.33: it stays), then 3 (7: its share, and the one tensor left
    # is exactly what the last owner needs), the last takes the last 3.
    assert owners((6, 2, 2, 3, 3), 3) == (0, 1, 1, 1, 2)
    # More owners than tensors: one tensor each, the last ranks own nothing.
    assert owners((10, 1), 4) == (0, 1)
    assert owned_ranges((10, 1), 4) == ((0, 10), (10, 1), (0, 0), (0, 0))
    # One huge tensor first: it takes the first owner; the small ones share the next.
    assert owners((100, 1, 1, 1), 2) == (0, 1, 1, 1)
    # max(1, int(density x numel)); norms and biases whole, by the authors' name parts ("ln"
    # is not one of them: ranked, int(0.8) = 0, so 1); density 1: every entry.
    assert mask_sizes(("w", "v", "proj.bias", "ln.weight"), (25, 3, 4, 8), 0.1, True) == (2, 1, 4, 1)
    assert mask_sizes(("w", "layer_norm.weight"), (10, 8), 0.3, True) == (3, 8)
    assert mask_sizes(("w", "layer_norm.weight"), (10, 8), 0.3, False) == (3, 2)
    assert mask_sizes(("w",), (10,), 1.0, True) == (10,)
    # A normalization layer's parameters go whole whatever their names (GPT-2's "ln_1").
    assert mask_sizes(("ln_1.weight", "w"), (8, 10), 0.3, True, frozenset({"ln_1.weight"})) == (8, 3)
    names = sparsecomm.hooks.state.memories.ParameterNames()
    block = torch.nn.Sequential()
    block.add_module("ln_1", torch.nn.LayerNorm(4))
    block.add_module("attn", torch.nn.Linear(4, 4))
    block.add_module("norm2", torch.nn.RMSNorm(4))
    names.bind(block)
    assert names.of_norms == {"ln_1.weight", "ln_1.bias", "norm2.weight"}
    bits = torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 1, 1], dtype=torch.bool)
    packed = pack_bits(bits, 3)
    assert packed.tolist() == [0b10000001, 0b00000011, 0]  # least significant bit first, zero padded
    assert torch.equal(unpack_bits(packed, 10), bits)


def _steady_bytes(rank, world_size, layers=1):
    """(sent, received) of step 3 (steady: the mask of the step before, a bitmap for the next)
    at density 0.02 under AdamS: one 100 x 50 bias-free layer, or ``layers`` of 40 x 40."""
    torch.manual_seed(0)
    width = 50 if layers == 1 else 40
    model = torch.nn.Linear(50, 100, bias=False) if layers == 1 else torch.nn.Sequential(
        *(torch.nn.Linear(40, 40, bias=False) for _ in range(layers)))
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
    optimizer = AdamS(ddp.parameters(), lr=1e-3)
    state = sparsecomm.register_topk_hook(ddp, density=0.02, exchange="shared-mask", optimizer=optimizer)
    for x in rank_data(rank, 4, (4, width)):
        ddp(x).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    last = state.stats()["last_step"]
    return last["bytes_sent"], last["bytes_received"]


def _four_tensors(rank, world_size):
    return _steady_bytes(rank, world_size, layers=4)


@pytest.mark.parametrize("world_size", [2, 4])
def test_bytes_are_values_and_a_bitmap_flat_in_p(world_size):
    # One 100 x 50 layer: k = int(0.02 x 5000) = 100 values, float32, allreduced; one owner
    # holds the whole bucket, so its bitmap (625 bytes) goes by allreduce (each owner sets its
    # own bits): 2 (p-1)/p x 625 received, which is below the all-gather's (p - 1) x (625 + 8).
    rows = run_on_ranks(_steady_bytes, world_size=world_size)
    ring = lambda n: round(2 * (world_size - 1) * n / world_size)  # noqa: E731
    assert rows == [(4 * 100 + 625, ring(4 * 100) + ring(625))] * world_size


def test_even_owners_send_their_bitmaps_by_all_gather_sealed():
    # 4 layers of 40 x 40 at 4 ranks: one tensor per owner, slots of 1600 / 8 = 200 bytes + an
    # 8-byte seal; the all-gather brings 3 x 208 = 624 bytes, below the allreduce's
    # 2 x 3/4 x 800 = 1200. Values: int(0.02 x 1600) = 32 per tensor, 128 in all.
    rows = run_on_ranks(_four_tensors, world_size=4)
    assert rows == [(4 * 128 + 208, round(2 * 3 * 4 * 128 / 4) + 3 * 208)] * 4


def _resumed(rank, world_size, split):
    """6 steps; with ``split``, a fresh model, AdamS and state loaded from a checkpoint taken
    after ``split`` steps run the rest (the mask of the next step is in the checkpoint)."""

    def build():
        ddp = torch.nn.parallel.DistributedDataParallel(Tiny(), bucket_cap_mb=0.0002)
        optimizer = AdamS(ddp.parameters(), lr=LR)
        state = sparsecomm.register_topk_hook(ddp, density=DENSITY, exchange="shared-mask", optimizer=optimizer,
                                              density_schedule={"kind": "geometric", "steps": DENSITY_WARMUP})
        return ddp, optimizer, state

    def loss(ddp, x):
        return torch.nn.functional.mse_loss(ddp(x), torch.sin(x[:, :4]))

    ddp, optimizer, state = build()
    for step, x in enumerate(rank_data(rank, 6, (8, 6))):
        if step == split:
            saved = (ddp.module.state_dict(), optimizer.state_dict(), state.state_dict())
            ddp, optimizer, state = build()
            ddp.module.load_state_dict(saved[0])
            optimizer.load_state_dict(saved[1])
            state.load_state_dict(saved[2])
            rebuild_buckets(ddp, state, lambda: (loss(ddp, x) * 0).backward())
        optimizer.zero_grad()
        loss(ddp, x).backward()
        optimizer.step()
    saved = state.state_dict()
    masks = sorted(key.split(".mask.")[1] for key in saved if ".mask." in key)
    return torch.cat([p.detach().flatten() for p in ddp.parameters()]), masks == sorted(state.names.shapes)


def test_a_resumed_run_trains_as_the_uninterrupted_one():
    straight = run_on_ranks(_resumed, None, world_size=2)
    resumed = run_on_ranks(_resumed, 4, world_size=2)
    for (a, every_parameter_masked), (b, _) in zip(straight, resumed):
        assert torch.equal(a, b)
        assert every_parameter_masked  # the checkpoint holds the next mask of every parameter


@pytest.mark.parametrize("settings,message", [
    ({"exchange": "shared-mask", "selector": "chunk"}, "selector='exact'"),
    ({"exchange": "shared-mask", "value_codec": "int4"}, "float wire"),
    ({"exchange": "shared-mask", "k_scope": "parameter"}, "k_scope='bucket'"),
    ({"exchange": "shared-mask", "momentum": 0.9}, "momentum=0"),
    ({"mask_dense_norms": False}, "mask_dense_norms=False is a setting of exchange='shared-mask'"),
    ({"exchange": "shared-mask", "density_schedule": {"kind": "geometric", "steps": 0}}, "steps"),
    ({"exchange": "shared-mask", "density_schedule": {"kind": "geometric", "steps": 4, "start": 0.001}}, "start"),
])
def test_bad_combinations_are_refused_by_name(settings, message):
    with pytest.raises(ValueError, match=message):
        sparsecomm.TopKState(**settings)


def _registration_errors(rank, world_size):
    found = []
    for optimizer, options in ((None, {}), ("adamw", {}), ("adams", {"momentum": 0.9})):
        ddp = torch.nn.parallel.DistributedDataParallel(Tiny())
        opt = {None: None, "adamw": torch.optim.AdamW(ddp.parameters()), "adams": AdamS(ddp.parameters())}[optimizer]
        try:
            sparsecomm.register_topk_hook(ddp, density=0.1, exchange="shared-mask", optimizer=opt, **options)
        except ValueError as error:
            found.append(str(error))
    # A state built by hand and never linked to AdamS: refused at the first bucket, before any collective.
    ddp = torch.nn.parallel.DistributedDataParallel(Tiny())
    ddp.register_comm_hook(sparsecomm.TopKState(density=0.1, exchange="shared-mask", module=ddp), sparsecomm.topk_hook)
    try:
        ddp(torch.ones(2, 6)).sum().backward()
    except Exception as error:  # noqa: BLE001  (DDP re-raises the hook's error as it is or wrapped)
        found.append(str(error))
    return found


def test_registration_needs_adams_and_no_momentum_of_the_hook():
    found = run_on_ranks(_registration_errors, world_size=2)[0]
    assert len(found) == 4
    assert "optimizer=sparsecomm.optim.AdamS" in found[0] and "got None" in found[0]
    assert "got AdamW" in found[1]
    assert "momentum must be left unset or 0" in found[2]
    assert "attach_optimizer" in found[3]


def test_adams_steps_only_on_the_mask_worked_by_hand():
    class Masks:
        def __init__(self, mask):
            self.mask = mask

        def mask_of(self, param):
            return self.mask

    p = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    optimizer = AdamS([p], lr=0.1, betas=(0.5, 0.75), eps=0.0, weight_decay=0.0)
    p.grad = torch.tensor([1.0, 1.0, 1.0])
    optimizer.step()  # step 1, no mask: m = 0.5, c = 0.5, v = 0.25 x 1 = 0.25: each moves by 0.1 x 1 / 0.5
    assert torch.allclose(p.detach(), torch.tensor([0.8, 1.8, 2.8]))
    optimizer.follow_masks(Masks(torch.tensor([True, False, True])))
    p.grad = torch.tensor([2.0, 5.0, 0.0])
    optimizer.step()
    # Step 2, c = 0.75. On the mask: v = 0.75 (0.5 / 0.75)^2 + 0.25 g^2, m = 0.25 + 0.5 g.
    # Entry 0: v = 1/3 + 1 = 4/3, m = 1.25: moves by 0.1 x (1.25 / 0.75) / sqrt(4/3).
    # Entry 2: v = 1/3, m = 0.25: moves by 0.1 x (0.25 / 0.75) / sqrt(1/3).
    # Entry 1 (off): moment zeroed and its gradient taken as 0 (the hook sends 0 there): no
    # step even at eps 0 (no 0 / 0), and the moment stays 0.
    want = torch.tensor([0.8 - 0.1 * (1.25 / 0.75) / math.sqrt(4 / 3), 1.8, 2.8 - 0.1 * (0.25 / 0.75) / math.sqrt(1 / 3)])
    assert torch.allclose(p.detach(), want, rtol=0, atol=4 * U * 3)
    assert optimizer.state[p]["exp_avg"].tolist() == pytest.approx([1.25, 0.0, 0.25])
    with pytest.raises(TypeError, match="mask_of"):
        optimizer.follow_masks(object())


def _corrupted_bitmap(rank, world_size, how):
    """Train the four-tensor model (bitmaps by all-gather at 4 ranks); on rank 1 the bitmap is
    changed after its seal ("flip"), or holds one entry too many before it ("extra"). What
    every rank raised, by type and message."""
    from sparsecomm.hooks.wires import shared_mask

    if rank == 1:
        seal, select = shared_mask.integrity.seal, shared_mask.owner_selection

        def flipped(slot, *args):
            seal(slot, *args)
            slot[0] ^= 1

        def one_more(corrected, numels, ks, start, length):
            bits = select(corrected, numels, ks, start, length)
            bits[(~bits).nonzero()[0]] = True
            return bits

        if how == "flip":
            shared_mask.integrity.seal = flipped
        else:
            shared_mask.owner_selection = one_more
    try:
        _four_tensors(rank, world_size)
    except Exception as error:  # noqa: BLE001  (DDP may re-raise the hook's error wrapped)
        return type(error).__name__, str(error)
    return None


@pytest.mark.parametrize("how,message", [("flip", "mask bitmap of rank(s) [1] does not match its CRC-32C"),
                                         ("extra", "wrong number of entries")])
def test_a_bad_mask_bitmap_is_refused_on_every_rank(how, message):
    raised = run_on_ranks(_corrupted_bitmap, how, world_size=4)
    for outcome in raised:
        assert outcome is not None and message in outcome[1], outcome
