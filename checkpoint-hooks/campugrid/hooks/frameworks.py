"""The frameworks' own checkpoints, taken the moment they are written (autosave.py says how this
is started). Nothing is imported here until the job imports the framework itself: an import hook
waits for the module that defines what is patched, lets it load, then patches it.

- Hugging Face transformers (`Trainer`): each `checkpoint-<step>/` folder once the Trainer says
  it saved it (its `on_save` callback); `train()` without `resume_from_checkpoint` resumes from
  the checkpoint put back; a drain (SIGTERM) saves at the end of the current step and stops.
- PyTorch Lightning (`lightning` or `pytorch_lightning`): each file `Trainer.save_checkpoint`
  wrote (ModelCheckpoint's included), as step `global_step`, with the random states Lightning
  leaves out (so a resumed run repeats one never stopped); `fit()` without `ckpt_path` (or with
  "last") resumes from the one put back; a drain saves at the end of the current batch, beside
  ModelCheckpoint's files, where Lightning can resume its data loaders mid-epoch (it says a
  mid-epoch resume of others is unreliable: then its own SIGTERM handling stops the job and the
  last checkpoint stands).
- Keras (`BackupAndRestore`): its backup folder each time it is written, as step
  `optimizer.iterations`; BackupAndRestore itself resumes from it. Keras resumes only at an
  epoch's start, so a drain keeps the last backup rather than save mid-epoch.

A framework whose classes do not have what a patch needs is left alone, with one line in the
job's log; the folder watch (`"checkpoints": {"dir": ...}`) still applies.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from campugrid.hooks import autosave

draining = threading.Event()  # SIGTERM came while the framework trains: save, then stop
training = threading.Event()  # the framework is in its training loop


class UnknownVersion(Exception):
    pass


def _on_drain() -> None:
    """SIGTERM sets `draining`; the framework saves at its next step, then the job exits."""
    if threading.current_thread() is not threading.main_thread():
        autosave.say("SIGTERM is not handled (the framework started outside the main thread): "
                     "a drain keeps the last checkpoint the framework wrote")
        return
    signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, frame: Any) -> None:
    if training.is_set():
        draining.set()  # the framework saves at its next step, then the job exits
    else:  # before or after training (data preparation, evaluation): nothing to save
        autosave.say("drained outside the training loop; stopping")
        os._exit(autosave.DRAINED)


def _stop_drained(step: int) -> None:
    autosave.say(f"drained: the checkpoint of step {step} is taken; stopping")
    raise SystemExit(autosave.DRAINED)


def _needs(cls: type, *names: str) -> None:
    missing = [n for n in names if not hasattr(cls, n)]
    if missing:
        raise UnknownVersion(f"{cls.__module__}.{cls.__name__} has no {', '.join(missing)}")


# --- Hugging Face transformers ----------------------------------------------------------


def hook_transformers(module: ModuleType) -> None:
    trainer_cls = module.Trainer
    _needs(trainer_cls, "train", "add_callback")
    callback_base = importlib.import_module("transformers.trainer_callback").TrainerCallback

    class Campugrid(callback_base):  # type: ignore[misc,valid-type]
        def on_train_begin(self, *_: Any, **__: Any) -> None:
            training.set()

        def on_train_end(self, *_: Any, **__: Any) -> None:
            training.clear()

        def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            if draining.is_set():
                control.should_save = True
                control.should_training_stop = True

        def on_save(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            if getattr(args, "should_save", True):
                folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
                if folder.is_dir():
                    autosave.take(int(state.global_step), [folder], "transformers")
            if draining.is_set():
                _stop_drained(int(state.global_step))

    init, train = trainer_cls.__init__, trainer_cls.train

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.add_callback(Campugrid)
        autosave.framework_takes_over("transformers")
        _on_drain()

    @functools.wraps(train)
    def train_(self: Any, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        if resume_from_checkpoint is None:
            entry = autosave.resumed_entry("transformers")
            if entry is not None and entry.is_dir():
                resume_from_checkpoint = str(entry)
        return train(self, resume_from_checkpoint, *args, **kwargs)

    trainer_cls.__init__, trainer_cls.train = __init__, train_


# --- PyTorch Lightning ------------------------------------------------------------------


def hook_lightning(module: ModuleType) -> None:
    trainer_cls = module.Trainer
    _needs(trainer_cls, "fit", "save_checkpoint", "global_step", "is_global_zero")
    package = module.__name__.split(".trainer.")[0]  # lightning.pytorch, or pytorch_lightning
    callback_base = importlib.import_module(f"{package}.callbacks").Callback

    class Campugrid(callback_base):  # type: ignore[misc,valid-type]
        # Lightning keeps no random state in its checkpoints: a resumed run would shuffle and
        # drop out differently from one never stopped. Kept here, as HF's Trainer keeps it.
        def state_dict(self) -> dict[str, Any]:
            return rng_states()

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            set_rng_states(state_dict)

        def on_train_start(self, *_: Any) -> None:
            training.set()

        def on_train_end(self, *_: Any) -> None:
            training.clear()

        def on_train_batch_end(self, trainer: Any, *_: Any) -> None:
            if not draining.is_set() or not _resumable_mid_epoch(trainer):
                return  # Lightning's own SIGTERM handling stops it after this batch
            ckpt = getattr(trainer, "checkpoint_callback", None)
            folder = Path(getattr(ckpt, "dirpath", None)
                          or os.path.join(trainer.default_root_dir, "checkpoints"))
            step = int(trainer.global_step)
            trainer.save_checkpoint(folder / f"epoch={trainer.current_epoch}-step={step}.ckpt")
            _stop_drained(step)

    def _resumable_mid_epoch(trainer: Any) -> bool:
        """Lightning's own rule: a run resumed mid-epoch repeats the one never stopped only if
        its training data loaders keep their place (else it warns that results are unreliable,
        and a drain keeps the last checkpoint instead)."""
        fabric = "lightning.fabric" if package.startswith("lightning.") else "lightning_fabric"
        try:
            stateful = importlib.import_module(f"{fabric}.utilities.types")._Stateful
            loaders = trainer.fit_loop._combined_loader.flattened
            return all(isinstance(loader, stateful) for loader in loaders)
        except Exception:
            return False

    init, fit, save = trainer_cls.__init__, trainer_cls.fit, trainer_cls.save_checkpoint

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.callbacks.append(Campugrid())
        autosave.framework_takes_over("lightning")
        _on_drain()

    @functools.wraps(save)
    def save_checkpoint(self: Any, filepath: Any, *args: Any, **kwargs: Any) -> None:
        save(self, filepath, *args, **kwargs)
        path = Path(filepath)
        if self.is_global_zero and path.exists() and not path.is_symlink():
            autosave.take(int(self.global_step), [path], "lightning")

    @functools.wraps(fit)
    def fit_(self: Any, model: Any, train_dataloaders: Any = None, val_dataloaders: Any = None,
             datamodule: Any = None, ckpt_path: Any = None, *args: Any, **kwargs: Any) -> Any:
        if ckpt_path in (None, "last"):
            entry = autosave.resumed_entry("lightning")
            if entry is not None and entry.is_file():
                ckpt_path = str(entry)
        return fit(self, model, train_dataloaders, val_dataloaders, datamodule, ckpt_path,
                   *args, **kwargs)

    trainer_cls.__init__, trainer_cls.fit = __init__, fit_
    trainer_cls.save_checkpoint = save_checkpoint


def rng_states() -> dict[str, Any]:
    """Python's, NumPy's and PyTorch's random states (of those the job imported)."""
    import random

    states: dict[str, Any] = {"python": random.getstate()}
    if "numpy" in sys.modules:  # plain values: a checkpoint loads with weights_only
        name, keys, pos, has_gauss, cached = sys.modules["numpy"].random.get_state()
        states["numpy"] = (name, keys.tolist(), pos, has_gauss, cached)
    if "torch" in sys.modules:
        states["torch"] = sys.modules["torch"].get_rng_state()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    import random

    if "python" in states:
        random.setstate(states["python"])
    if "numpy" in states and "numpy" in sys.modules:
        np = sys.modules["numpy"]
        name, keys, pos, has_gauss, cached = states["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "torch" in states and "torch" in sys.modules:
        sys.modules["torch"].set_rng_state(states["torch"])


# --- Keras ------------------------------------------------------------------------------


def hook_keras(module: ModuleType) -> None:
    backup_cls = module.BackupAndRestore
    _needs(backup_cls, "_save_model", "_load_model")
    save, load, init = backup_cls._save_model, backup_cls._load_model, backup_cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        autosave.framework_takes_over("keras")

    @functools.wraps(save)
    def _save_model(self: Any, *args: Any, **kwargs: Any) -> None:
        save(self, *args, **kwargs)
        folder = Path(self.backup_dir)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and folder.is_dir():
            # Keras keeps no random state in its backup: a resumed run would shuffle
            # differently from one never stopped. Kept beside it.
            (folder / RNG_FILE).write_text(json.dumps(_plain(rng_states())))
            autosave.take(int(optimizer.iterations), [folder], "keras")

    @functools.wraps(load)
    def _load_model(self: Any, *args: Any, **kwargs: Any) -> None:
        load(self, *args, **kwargs)
        with contextlib.suppress(OSError, ValueError):
            set_rng_states(_unplain(json.loads((Path(self.backup_dir) / RNG_FILE).read_text())))

    backup_cls._save_model, backup_cls._load_model = _save_model, _load_model
    backup_cls.__init__ = __init__


RNG_FILE = "campugrid-random-state.json"


def _plain(states: dict[str, Any]) -> dict[str, Any]:
    """The random states as JSON: tuples as lists, PyTorch's byte tensor as a list of ints."""
    out: dict[str, Any] = {"python": [states["python"][0], list(states["python"][1]),
                                      states["python"][2]]}
    if "numpy" in states:
        out["numpy"] = list(states["numpy"])
    if "torch" in states:
        out["torch"] = states["torch"].tolist()
    return out


def _unplain(states: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"python": (states["python"][0], tuple(states["python"][1]),
                                      states["python"][2])}
    if "numpy" in states:
        out["numpy"] = tuple(states["numpy"])
    if "torch" in states and "torch" in sys.modules:
        torch = sys.modules["torch"]
        out["torch"] = torch.tensor(states["torch"], dtype=torch.uint8)
    return out


HOOKS: dict[str, Callable[[ModuleType], None]] = {
    "transformers.trainer": hook_transformers,
    "lightning.pytorch.trainer.trainer": hook_lightning,
    "pytorch_lightning.trainer.trainer": hook_lightning,
    "keras.src.callbacks.backup_and_restore": hook_keras,
}


class _Patching(importlib.abc.Loader):
    """The module's own loader, then the patch."""

    def __init__(self, loader: Any, hook: Callable[[ModuleType], None]) -> None:
        self._loader, self._hook = loader, hook

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        made: ModuleType | None = self._loader.create_module(spec)
        return made

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        try:
            self._hook(module)
        except Exception as e:  # a version we do not know: leave it as it is
            top = module.__name__.split(".")[0]
            version = getattr(sys.modules.get(top), "__version__", "?")
            autosave.say(f"{top} {version} is not a version the checkpoint hooks know ({e}); "
                         "its checkpoints are taken only from a folder the job names "
                         '("checkpoints": {"dir": ...})')

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ...: the loader's own
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        hook = HOOKS.get(fullname)
        if hook is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Patching(spec.loader, hook)
                return spec
        return None


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
