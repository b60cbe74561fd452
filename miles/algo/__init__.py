"""RL math as pure tensor functions: advantages, policy losses, KL estimators, corrections.

Importing the package imports every implementation module, which fills the registries of
`miles.algo.registry` whichever submodule a caller imports first.
"""

from miles.algo import advantages, corrections, kl, losses, policy_losses  # noqa: F401
