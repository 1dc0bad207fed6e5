"""The workshop: builders of tiny, randomly initialised models and rewards for tests, CPU smoke runs and GPU
memory / speed estimates, without downloads. Not part of the training API: nothing else in ``stepflow`` imports
this package (``tests/test_layers.py``); the ``model=*_tiny`` / ``model=*_random`` and ``reward=pickscore_tiny``
configs name it in their ``_target_``.

- :mod:`stepflow.testing.tiny_policies`: tiny diffusers pipelines of every supported family (SD3.5-Medium / -Large,
  FLUX.1-dev / -schnell, Qwen-Image) written as normal pipeline folders, so the real loading code runs end to end
  (``model=*_tiny``), and a tiny TAESD for the x0 estimates;
- :mod:`stepflow.testing.random_policies`: the published transformer / VAE architectures with random weights, at full
  size or tiny, in stepflow's own policy classes (``model=*_random``), a stand-in reward, exact parameter counts and
  per-GPU memory estimates (``experiments/gpu_check.py``);
- :mod:`stepflow.testing.tiny_rewards`: a tiny random CLIP scored with PickScore's formula (``reward=pickscore_tiny``).
"""
