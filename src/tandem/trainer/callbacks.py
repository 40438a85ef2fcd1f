"""transformers' callbacks in tandem's loop: the handler, the names evaluations are given to them under, and the state
of stateful callbacks (transformers' `ExportableState`) carried through checkpoints."""

from collections import defaultdict

from transformers import TrainerControl
from transformers.trainer_callback import CallbackHandler, ExportableState
from transformers.utils import logging as hf_logging


def callback_handler(callbacks: list, model, tokenizer, optimizer, scheduler) -> CallbackHandler:
    """transformers' CallbackHandler, without its warning that no DefaultFlowCallback is present: tandem's loop decides
    when to log and save (`logging_steps`, `save_steps`) and honours the flags callbacks set in `control`."""
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return CallbackHandler(callbacks, model, tokenizer, optimizer, scheduler)
    finally:
        hf_logging.set_verbosity(verbosity)


def with_transformers_names(metrics: dict) -> dict:
    """An evaluation's metrics as callbacks see them: tandem's `eval/reward` also as transformers' `eval_reward`, the
    name EarlyStoppingCallback and scripts written for transformers look up."""
    return metrics | {"eval_" + name.removeprefix("eval/"): value for name, value in metrics.items() if name.startswith("eval/")}


def exported_states(handler: CallbackHandler, control: TrainerControl) -> dict:
    """{class name: state, or a list of states for several of a class} of every callback that exports its state, and
    of `control`: what transformers writes to a checkpoint's trainer_state.json as `stateful_callbacks`."""
    grouped = defaultdict(list)
    for callback in handler.callbacks + [control]:
        if isinstance(callback, ExportableState):
            grouped[type(callback).__name__].append(callback.state())
    return {name: states[0] if len(states) == 1 else states for name, states in grouped.items()}


def restore_states(handler: CallbackHandler, control: TrainerControl, stored: dict) -> tuple[TrainerControl, list[str]]:
    """restore_callback_states_from_checkpoint: each stored state rebuilds the callback of its class in `handler` (in
    order, for several of one class) and `control`; returns the control to use and the stored classes no callback of
    this run matches (transformers warns about those and leaves them)."""
    unmatched = []
    for name, states in stored.items():
        present = [c for c in handler.callbacks + [control] if type(c).__name__ == name]
        if not present:
            unmatched.append(name)
            continue
        for callback, state in zip(present, states if isinstance(states, list) else [states]):
            rebuilt = type(callback)(**state.get("args", {}))
            for attribute, value in state.get("attributes", {}).items():
                setattr(rebuilt, attribute, value)
            if isinstance(callback, TrainerControl):
                control = rebuilt
            else:
                handler.remove_callback(callback)
                handler.add_callback(rebuilt)
    return control, unmatched
