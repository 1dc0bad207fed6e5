"""stepflow: stepwise credit assignment for GRPO on flow-matching text-to-image models.

The modules stand on floors. A module imports from its own floor and the floors below, never from a floor above,
and no modules import one another round a loop; imports inside functions count the same (``tests/test_layers.py``
reads this list and checks both). A name stands for that module, or that package and everything in it:

0. errors (the error types; imports nothing from stepflow): errors
1. math (the pure math, prompts, the stop flag, the embedded shapes world, the samplers and windows, and the part
   builder): sde, solvers, advantage, loss, forward, window, estimate, coherence, weighting, data, stop, shapes,
   branch_credit, retain, budget, samplers, windows, core.parts
2. models (the policies, the rewards, and the typed settings, which check the models' own): policies, rewards, config
3. core (one GRPO iteration, free of Lightning: the rollout strategies, the credits, the objectives, the update, the
   requirements between the parts, and the held-out evaluation): core, rollouts, credits, rollout, branch,
   branch_loop, objectives, algorithm, dist, ema, heldout
4. shell (Lightning: the module, strategies, checkpoints, logs): grpo, sharding, deepspeed_strategy,
   checkpoint, loggers, plots
5. entry points (the Hydra commands and their plumbing): cli, rundir, train, evaluate, pretrain, serve_reward
6. workshop (tiny and random builders for tests and estimates; nothing else imports it): testing
"""

__version__ = "0.1.0"
