"""Capture and restore every random number generator a rank uses.

Python's ``random``, NumPy's global state, torch's CPU generator, every CUDA device's
generator when CUDA is in use, and the generators the project owns (passed by name).
States are stored as tensors, ints and strings only, so checkpoints load with
``torch.load(weights_only=True)``.
"""
import random

import numpy as np
import torch


def capture_rng(generators: dict[str, torch.Generator] | None = None) -> dict:
    version, mt_state, gauss = random.getstate()
    np_key, np_state, np_pos, np_has_gauss, np_cached = np.random.get_state()
    state = {
        "python": {"version": version, "state": torch.tensor(mt_state, dtype=torch.int64), "gauss": gauss},
        "numpy": {"key": np_key, "state": torch.from_numpy(np_state.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "cached": float(np_cached)},
        "torch": torch.get_rng_state(),
        "owned": {name: g.get_state() for name, g in (generators or {}).items()},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict, generators: dict[str, torch.Generator] | None = None) -> None:
    python = state["python"]
    random.setstate((python["version"], tuple(python["state"].tolist()), python["gauss"]))
    np_state = state["numpy"]
    np.random.set_state((np_state["key"], np_state["state"].numpy().astype(np.uint32), np_state["pos"],
                         np_state["has_gauss"], np_state["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    generators = generators or {}
    missing = sorted(set(state["owned"]) ^ set(generators))
    if missing:
        raise ValueError(f"owned generators differ between checkpoint and job: {missing}")
    for name, generator in generators.items():
        generator.set_state(state["owned"][name])


def check_rng(state: dict, generators: dict[str, torch.Generator] | None = None) -> None:
    """Raise ValueError unless :func:`restore_rng` would accept ``state`` for ``generators``.

    Every state is set on a throwaway generator of the same kind, so nothing this process
    draws from changes.
    """
    generators = generators or {}
    if not isinstance(state, dict) or not {"python", "numpy", "torch", "owned"} <= set(state):
        raise ValueError("RNG state lacks one of python, numpy, torch, owned")
    missing = sorted(set(state["owned"]) ^ set(generators))
    if missing:
        raise ValueError(f"owned generators differ between checkpoint and job: {missing}")
    python = state["python"]
    random.Random().setstate((python["version"], tuple(python["state"].tolist()), python["gauss"]))
    np_state = state["numpy"]
    np.random.RandomState().set_state((np_state["key"], np_state["state"].numpy().astype(np.uint32),
                                       np_state["pos"], np_state["has_gauss"], np_state["cached"]))
    torch.Generator().set_state(state["torch"])
    for name, generator in generators.items():
        torch.Generator(device=generator.device).set_state(state["owned"][name])
    if "cuda" in state and torch.cuda.is_available():
        if len(state["cuda"]) > torch.cuda.device_count():  # what restore_rng could not set
            raise ValueError(f"RNG state holds {len(state['cuda'])} CUDA generator(s), this process sees "
                             f"{torch.cuda.device_count()} device(s)")
        for device, cuda_state in enumerate(state["cuda"]):
            torch.Generator(device=f"cuda:{device}").set_state(cuda_state)
