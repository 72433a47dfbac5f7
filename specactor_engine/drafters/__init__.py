"""Draft methods: one module per method, each registered by its config `kind`."""

from specactor_engine.drafters import feature, model, ngram, suffix  # noqa: F401  (registration)
from specactor_engine.drafters.base import DRAFTER_REGISTRY, DraftRequest, Drafter, DrafterContext, build_drafter

__all__ = ["DRAFTER_REGISTRY", "DraftRequest", "Drafter", "DrafterContext", "build_drafter"]
