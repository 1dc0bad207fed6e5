"""stepflow: stepwise credit assignment for GRPO on flow-matching text-to-image models.

The modules stand on floors. A module imports from its own floor and the floors below, never from a floor above,
and no modules import one another round a loop; imports inside functions count the same (``tests/test_layers.py``
reads this list and checks both). A name stands for that module, or that package and everything in it:

0. errors (the error types; imports nothing from stepflow): errors
1. math (the pure math in math/, the sampler and window parts, the prompts, the stop flag, the budget, the retained
   graphs, the part builder and the embedded shapes world; sde is math.sde's earlier import path): math, samplers,
   windows, core.parts, core.data, core.stop, core.budget, core.retain, shapes, sde
2. models (the policies, the rewards, and the typed settings, which check the models' own): policies, rewards, config
3. core (one GRPO iteration, free of Lightning, in core/: the iteration, the rollout, the update, the requirements
   between the parts, ranks, EMA copies and the held-out evaluation; the rollout strategies, the credits and the
   objectives): core, rollouts, credits, objectives
4. shell (Lightning: the module, and in shell/ the strategies, checkpoints, logs and plots): grpo, shell
5. entry points (the Hydra commands and their plumbing): cli, rundir, train, evaluate, pretrain, serve_reward
6. workshop (tiny and random builders for tests and estimates; nothing else imports it): testing

The folders: core/ runs an iteration; samplers/, windows/, credits/, rollouts/, objectives/ and rewards/ hold one
file per part (its YAML in conf/<group>/); math/ the math they share; policies/ the models; shapes/ the embedded
world; shell/ the Lightning around it; the top level the entry points, the settings and the errors.
"""

__version__ = "0.1.0"
