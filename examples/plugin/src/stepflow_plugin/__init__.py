"""A researcher's own parts for stepflow, kept outside the package (examples/plugin/README.md).

One module per part, each named by a YAML of ``examples/plugin/conf/<group>/`` through its ``_target_``:

- :mod:`stepflow_plugin.brightness`: a reward (``reward=brightness``);
- :mod:`stepflow_plugin.rank_credit`: a credit scheme (``advantage=rank``);
- :mod:`stepflow_plugin.em_sampler`: a rollout sampler (``sampler=em_sde``);
- :mod:`stepflow_plugin.weighted_fm`: an objective (``objective=weighted_fm``).

Nothing is imported here: stepflow imports each module by its ``_target_`` when the option is chosen.
"""
