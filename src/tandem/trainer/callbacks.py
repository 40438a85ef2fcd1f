"""transformers' callbacks in tandem's loop: `Callbacks` calls them and keeps the flags they set, as transformers'
Trainer does; also the names evaluations are given to them under, and the state of stateful callbacks (transformers'
`ExportableState`) carried through checkpoints."""

from collections import defaultdict

from transformers import TrainerControl
from transformers.trainer_callback import CallbackHandler, ExportableState
from transformers.utils import logging as hf_logging

from tandem.model.distributed import Ranks, local_main


def due(strategy: str, every: int, step: int, epoch_ended: bool) -> bool:
    """An interval strategy's event at this step: 'steps' every `every` steps, 'epoch' when a pass over the dataset
    ended, 'no' (and 'best', decided by evaluations) never."""
    return (strategy == "steps" and step % every == 0) or (strategy == "epoch" and epoch_ended)


class Callbacks:
    """The run's TrainerCallback objects and the `control` flags they set (should_log, should_save,
    should_training_stop), read by the loop. The interval strategies set the same flags (`plan`: what transformers'
    DefaultFlowCallback does), on rank 0; `agreed` gives every rank rank 0's flags."""

    def __init__(self, handler: CallbackHandler, args, state, ranks: Ranks):
        self.handler, self.args, self.state, self.ranks = handler, args, state, ranks
        self.control = TrainerControl()

    def event(self, event: str, **kwargs) -> None:
        """Call every callback's `event` with (args, state, control)."""
        args, state = self.args, self.state
        state.is_world_process_zero, state.is_local_process_zero = self.ranks.main, local_main()
        state.max_steps, state.logging_steps, state.save_steps, state.eval_steps = (
            args.max_steps,
            args.every("logging_steps"),
            args.every("save_steps"),
            args.every("eval_steps"),
        )
        returned = getattr(self.handler, event)(args, state, self.control, **kwargs)
        if returned is not self.control:  # a callback that returned a control of its own: its flags count
            vars(self.control).update(vars(returned))

    def plan(self, epoch_ended: bool) -> None:
        """Whether this step logs (`log_due`) and saves (save_strategy 'steps', every save_steps, or 'epoch'), set on
        rank 0; the ranks agree on its flags next."""
        if self.ranks.main:
            self.control.should_log |= self.log_due(epoch_ended)
            self.control.should_save |= due(
                self.args.save_strategy, self.args.every("save_steps"), self.state.step, epoch_ended
            )

    def log_due(self, epoch_ended: bool) -> bool:
        """logging_strategy 'steps' (every logging_steps) or 'epoch', and after the first step with logging_first_step."""
        args, step = self.args, self.state.step
        return due(args.logging_strategy, args.every("logging_steps"), step, epoch_ended) or (
            args.logging_first_step and step == 1 and args.logging_strategy != "no"
        )

    def eval_due(self, epoch_ended: bool) -> bool:
        """eval_strategy 'steps' (every eval_steps, logging_steps when unset) or 'epoch', from eval_delay on."""
        args, step = self.args, self.state.step
        return step >= args.eval_delay and due(args.eval_strategy, args.every("eval_steps"), step, epoch_ended)

    def agreed(self) -> TrainerControl:
        """This step's flags as rank 0's callbacks set them, on every rank (logging and saving are collective);
        `on_step_begin` clears should_log and should_save, as in transformers."""
        flags = ("should_log", "should_save", "should_training_stop")
        return TrainerControl(
            **self.ranks.broadcast({f: getattr(self.control, f) for f in flags} if self.ranks.main else None)
        )

    def exported(self) -> dict:
        """What a checkpoint keeps of the callbacks' and the control's states (`exported_states`)."""
        return exported_states(self.handler, self.control)

    def restore(self, stored: dict) -> list[str]:
        """Rebuild the callbacks and the control from a checkpoint's states; returns the stored classes left unmatched."""
        self.control, unmatched = restore_states(self.handler, self.control, stored)
        return unmatched


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
    return metrics | {
        "eval_" + name.removeprefix("eval/"): value for name, value in metrics.items() if name.startswith("eval/")
    }


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


class CallbackMethods:
    """transformers' Trainer methods for its callbacks, on a trainer that keeps them in `callbacks`."""

    callbacks: Callbacks

    @property
    def callback_handler(self) -> CallbackHandler:
        """transformers' CallbackHandler, under the name its Trainer gives it."""
        return self.callbacks.handler

    def add_callback(self, callback) -> None:
        """Add a transformers `TrainerCallback` (an instance, or a class to instantiate)."""
        self.callback_handler.add_callback(callback)

    def pop_callback(self, callback):
        """Remove a callback (an instance, or the first of a class) and return it; None when absent."""
        return self.callback_handler.pop_callback(callback)

    def remove_callback(self, callback) -> None:
        """Remove a callback (an instance, or the first of a class)."""
        self.callback_handler.remove_callback(callback)
