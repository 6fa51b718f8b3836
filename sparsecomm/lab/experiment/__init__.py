"""Paired dense-vs-sparse experiments: config, arms, per-rank worker, runner."""
