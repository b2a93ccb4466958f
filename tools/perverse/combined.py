"""Implementations under test for API-1 (SPEC 1.3): hyperdsd, each with one
defect in its combined functions, or without them."""

from dataclasses import replace

from conformance.adapters import load_adapter


def _base(name, **changes):
    return replace(load_adapter("hyperdsd"), name=name, version="0", **changes)


def without_combined():
    """hyperdsd as an implementation that has the four functions only."""
    return _base("without-combined", get_state_dict=None, set_state_dict=None, combined=None)


def get_returns_none():
    """A combined get that returns None: its deviation, never the suite's error (SPEC §4)."""
    return _base("get-returns-none", get_state_dict=lambda model, optimizers, *, options=None: None)


def get_drops_a_key():
    """A combined get whose model dict lacks the first key the model gets."""
    base = load_adapter("hyperdsd")

    def get_state_dict(model, optimizers, *, options=None):
        msd, osd = base.get_state_dict(model, optimizers, options=options)
        return {k: v for i, (k, v) in enumerate(msd.items()) if i}, osd

    return _base("get-drops-a-key", get_state_dict=get_state_dict)


def set_ignores_strict():
    """A combined set that loads with strict=False whatever it is asked."""
    base = load_adapter("hyperdsd")

    def set_state_dict(model, optimizers, *, model_state_dict, optim_state_dict, options=None):
        return base.set_state_dict(
            model,
            optimizers,
            model_state_dict=model_state_dict,
            optim_state_dict=optim_state_dict,
            options=replace(options, strict=False),
        )

    return _base("set-ignores-strict", set_state_dict=set_state_dict)


def set_skips_an_empty_model():
    """A combined set that decides per rank, as torch's does for the model: a
    rank whose model dict is empty loads nothing and returns, so in a
    broadcast the root waits for ranks that never join it."""
    base = load_adapter("hyperdsd")

    def set_state_dict(model, optimizers, *, model_state_dict, optim_state_dict, options=None):
        if not model_state_dict:
            return None
        return base.set_state_dict(
            model,
            optimizers,
            model_state_dict=model_state_dict,
            optim_state_dict=optim_state_dict,
            options=options,
        )

    return _base("set-skips-an-empty-model", set_state_dict=set_state_dict)
