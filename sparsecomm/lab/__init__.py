"""The lab: paired dense-vs-sparse experiments and what they measure.

Installed with ``pip install 'sparsecomm[lab]'`` (scipy, matplotlib, scikit-learn on top of
the library's torch and numpy). It holds the experiment runner (:mod:`.experiment`), the
built-in tasks (:mod:`.tasks`), the time-to-quality ledger (:mod:`.ledger`), the
tolerance checker (:mod:`.tolerance`), plots, the frontier and scaling sweeps, the cost model,
what they all read (:mod:`.results`) and the ``sparsecomm`` command (:mod:`.cli`).

A training script of your own joins an experiment with :func:`init` (see
``docs/bring_your_own.md``)::

    run = sparsecomm.lab.init()
    optimizer = run.apply(ddp_model, optimizer)
    run.log({"val_loss": v}, step=s)
"""


def __getattr__(name):
    # Imported on first use: reading results must not import torch.
    if name in ("init", "Run"):
        from sparsecomm.lab.experiment import script_run

        return getattr(script_run, name)
    raise AttributeError(f"module 'sparsecomm.lab' has no attribute {name!r}")


__all__ = ["init", "Run"]
