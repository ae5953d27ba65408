"""The optimizer's hyperparameters as the command set names them: the fields of a param group,
the Adam/AdamW mode, and the keys SET_HYPERPARAMETERS takes. Every layer takes the names
from here."""
from __future__ import annotations

# The hyperparameters of one param group, in the order a superblock stores them.
GROUP_FIELDS = ("lr", "beta1", "beta2", "eps", "weight_decay")
# Those that must lie in [0, 1).
BETA_FIELDS = ("beta1", "beta2")
# The update rule, fixed when a namespace is created: "adamw" decays the weights apart from
# the gradient (AdamW; the kernels' `decoupled` flag), "adam" adds the L2 penalty to it.
ADAM = "adam"
ADAMW = "adamw"
MODES = (ADAMW, ADAM)
# What a SET_HYPERPARAMETERS payload may hold ("mode" only to be refused with a reason).
SET_HYPERPARAMETERS_KEYS = (*GROUP_FIELDS, "mode", "group")
