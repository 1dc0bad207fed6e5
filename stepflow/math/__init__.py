"""The pure math the parts share: time grids and one-step samplers with their log-probs, x̂0 estimates, gains and
advantages, the losses, the forward-process losses, the weighting of loss terms, the windows' step sets, the branch
credits' formulas and the multistep solvers. Tensors in, tensors out: no Lightning, no Hydra, no models."""
