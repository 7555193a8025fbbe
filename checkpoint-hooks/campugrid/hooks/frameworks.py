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
  ModelCheckpoint's files. Lightning resumes mid-epoch only loaders that keep their place
  (it warns a resume of others is unreliable); for a plain torch DataLoader the drain's
  checkpoint also keeps the random states its epoch began with and the batches trained, and
  the resumed attempt's loader draws the same order again and skips those. (Several training
  loaders of other kinds: Lightning's own SIGTERM handling stops the job, the last checkpoint
  stands.)
- Keras (`BackupAndRestore`): its backup folder each time it is written, as step
  `optimizer.iterations`, with the random states; BackupAndRestore itself resumes from it.
  Keras resumes only at an epoch's start: a drain backs up as of the epoch running, with the
  random states its pass over the data began with and the batches trained, and the resumed
  attempt's pass draws the same order again and skips those (on Keras's PyTorch backend, one
  pass an epoch; otherwise the last backup stands).

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
import weakref
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


_went_on = threading.Event()


def _first_step_done(step: int) -> None:
    """One line when a resumed attempt's first step is done: it went on, and from where."""
    if not _went_on.is_set() and os.environ.get(autosave.ENV_RESUMED, "").isdigit():
        _went_on.set()
        autosave.say(f"went on from the checkpoint put back: step {step} done")


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
            _first_step_done(int(state.global_step))
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
    loader_cls = importlib.import_module("torch.utils.data").DataLoader
    _needs(loader_cls, "__iter__")
    # The random states each DataLoader began its current pass with: what a drain's checkpoint
    # needs to draw the same order of batches again on another machine.
    began: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()

    class Campugrid(callback_base):  # type: ignore[misc,valid-type]
        """Lightning keeps no random state in its checkpoints (a resumed run would shuffle and
        drop out differently from one never stopped): kept here, as HF's Trainer keeps it.
        A drain's checkpoint, mid-epoch, also keeps where the epoch's data loader was: the
        state it began the epoch with, and how many batches were trained."""

        def __init__(self, trainer: Any) -> None:
            self.trainer = trainer
            self.mid_epoch: dict[str, Any] | None = None  # set for a drain's save only
            self.resume: dict[str, Any] = {}  # what a resumed attempt still has to put back

        def state_dict(self) -> dict[str, Any]:
            return {"rng": rng_states(), "mid_epoch": self.mid_epoch}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            if "rng" not in state_dict:  # as checkpoints of earlier hooks hold it
                set_rng_states(state_dict)
            elif state_dict.get("mid_epoch"):  # put back when the loader starts again
                self.resume = {**state_dict["mid_epoch"], "rng": state_dict["rng"]}
            else:
                set_rng_states(state_dict["rng"])

        def on_train_start(self, *_: Any) -> None:
            training.set()

        def on_train_end(self, *_: Any) -> None:
            training.clear()

        def on_train_batch_start(self, *_: Any) -> None:
            if "rng" in self.resume:  # the batches trained before the drain are skipped
                set_rng_states(self.resume.pop("rng"))
                self.resume.clear()

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any,
                               batch_idx: int, *_: Any) -> None:
            _first_step_done(int(trainer.global_step))
            if not draining.is_set():
                return
            loaders = _train_loaders(trainer)
            if not _resumable_mid_epoch(loaders):
                loader = loaders[0] if len(loaders) == 1 else None
                if (loader is None or getattr(loader, "persistent_workers", False)
                        or _began(loader) is None):
                    return  # Lightning's own SIGTERM handling stops it after this batch
                if not _may_stop_here(trainer):
                    # Not where a resumed run could go on exactly: at the next batch that is.
                    with contextlib.suppress(AttributeError):
                        trainer._signal_connector.received_sigterm = False
                    return
                self.mid_epoch = {"skip": batch_idx + 1, "began": _began(loader)}
            ckpt = getattr(trainer, "checkpoint_callback", None)
            folder = Path(getattr(ckpt, "dirpath", None)
                          or os.path.join(trainer.default_root_dir, "checkpoints"))
            step = int(trainer.global_step)
            trainer.save_checkpoint(folder / f"epoch={trainer.current_epoch}-step={step}.ckpt")
            _stop_drained(step)

    def _may_stop_here(trainer: Any) -> bool:
        """After an optimizer step (gradients being accumulated are in no checkpoint), not
        before a validation Lightning would skip on resuming, not an epoch's last batch
        (Lightning resumes that as the next epoch's start, with no pass of the data left)."""
        try:
            loop = trainer.fit_loop.epoch_loop
            return not (loop._should_accumulate() or loop._num_ready_batches_reached()
                        or loop._should_check_val_fx(trainer.fit_loop._data_fetcher))
        except Exception:
            return False

    def _began(loader: Any) -> dict[str, Any] | None:
        try:
            return began.get(loader)
        except TypeError:  # a DataLoader of a kind that cannot be a dictionary's key
            return None

    def _train_loaders(trainer: Any) -> list[Any]:
        try:
            return list(trainer.fit_loop._combined_loader.flattened)
        except Exception:
            return []

    def _resumable_mid_epoch(loaders: list[Any]) -> bool:
        """Lightning's own rule: its loaders that keep their place resume mid-epoch."""
        fabric = "lightning.fabric" if package.startswith("lightning.") else "lightning_fabric"
        try:
            stateful = importlib.import_module(f"{fabric}.utilities.types")._Stateful
            return bool(loaders) and all(isinstance(loader, stateful) for loader in loaders)
        except Exception:
            return False

    loader_iter = loader_cls.__iter__

    @functools.wraps(loader_iter)
    def __iter__(self: Any) -> Any:
        """A pass of a DataLoader (any, in this job): its random states are noted as it begins.
        A resumed attempt's training loader begins its epoch with the states the drained one
        began it with, and skips the batches trained before the drain: the same batches
        follow, and on the first, the random states of the drain."""
        resume = next((cb.resume for cb in list(callbacks) if cb.resume.get("skip")
                       and any(self is dl for dl in _train_loaders(cb.trainer))), None)
        if resume is None:
            with contextlib.suppress(TypeError):  # a kind of DataLoader that is no key
                began[self] = rng_states()
            return loader_iter(self)
        set_rng_states(resume["began"])
        with contextlib.suppress(TypeError):
            began[self] = resume["began"]
        batches = loader_iter(self)
        skip = resume.pop("skip")
        _skip(batches, skip)
        return batches

    callbacks: weakref.WeakSet[Campugrid] = weakref.WeakSet()
    init, fit, save = trainer_cls.__init__, trainer_cls.fit, trainer_cls.save_checkpoint

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        callback = Campugrid(self)
        callbacks.add(callback)
        self.callbacks.append(callback)
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
    loader_cls.__iter__ = __iter__


def _skip(batches: Any, skip: int) -> None:
    """A resumed pass over the training data: the batches trained before the drain drawn and
    left (fewer, if the data is shorter here than where it was drained)."""
    for _ in range(skip):
        if next(batches, None) is None:
            break
    autosave.say(f"the training data goes on at batch {skip} of its epoch, where the drained "
                 "attempt stopped")


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
    _needs(backup_cls, "_save_model", "_load_model", "on_train_begin", "on_train_end",
           "on_epoch_begin", "on_epoch_end", "on_train_batch_end")
    save, load, init = backup_cls._save_model, backup_cls._load_model, backup_cls.__init__
    train_begin, train_end = backup_cls.on_train_begin, backup_cls.on_train_end
    epoch_begin, epoch_end = backup_cls.on_epoch_begin, backup_cls.on_epoch_end
    batch_end = backup_cls.on_train_batch_end
    # The training pass of the epoch now running: the random states it began with, whether it
    # is one pass an epoch (steps_per_epoch not set), the batches a resumed attempt skipped.
    latest: dict[str, Any] = {}
    resume: dict[str, Any] = {}  # what a resumed attempt puts back when its pass begins
    passes: list[bool] = []  # hooked at the first BackupAndRestore: Keras is loaded by then

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if not passes:
            passes.append(_keras_passes(latest, resume))
        autosave.framework_takes_over("keras")
        _on_drain()

    @functools.wraps(save)
    def _save_model(self: Any, *args: Any, **kwargs: Any) -> None:
        save(self, *args, **kwargs)
        folder = Path(self.backup_dir)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and folder.is_dir():
            # Keras keeps no random state in its backup: a resumed run would shuffle
            # differently from one never stopped. Kept beside it, and for a drain's backup,
            # mid-epoch, where the epoch's pass over the data was.
            mid = getattr(self, "_campugrid_mid_epoch", None)
            (folder / RNG_FILE).write_text(json.dumps({"rng": _plain(rng_states()),
                                                       "mid_epoch": mid}))
            autosave.take(int(optimizer.iterations), [folder], "keras")

    @functools.wraps(load)
    def _load_model(self: Any, *args: Any, **kwargs: Any) -> None:
        load(self, *args, **kwargs)
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            kept = json.loads((Path(self.backup_dir) / RNG_FILE).read_text())
            if "rng" not in kept:  # as backups of earlier hooks hold it
                set_rng_states(_unplain(kept))
            elif kept.get("mid_epoch") and passes[0]:
                resume.update(skip=int(kept["mid_epoch"]["skip"]), rng=_unplain(kept["rng"]),
                              began=_unplain(kept["mid_epoch"]["began"]))
            else:
                set_rng_states(_unplain(kept["rng"]))

    @functools.wraps(train_begin)
    def on_train_begin(self: Any, *args: Any, **kwargs: Any) -> None:
        train_begin(self, *args, **kwargs)
        training.set()

    @functools.wraps(train_end)
    def on_train_end(self: Any, *args: Any, **kwargs: Any) -> None:
        training.clear()
        try:
            train_end(self, *args, **kwargs)  # removes the backup folder (delete_checkpoint)
        except OSError:
            # The folder the job's spec names is a mount in the sandbox: its files are gone,
            # the folder itself cannot be.
            folder = Path(self.backup_dir).absolute()
            if str(folder) != os.environ.get(autosave.ENV_FROM) or any(folder.iterdir()):
                raise

    @functools.wraps(epoch_begin)
    def on_epoch_begin(self: Any, epoch: int, *args: Any, **kwargs: Any) -> None:
        epoch_begin(self, epoch, *args, **kwargs)
        self._campugrid_epoch = epoch
        latest.update(skipped=0, next_is_training=True)  # the epoch's pass is made next

    @functools.wraps(epoch_end)
    def on_epoch_end(self: Any, *args: Any, **kwargs: Any) -> None:
        epoch_end(self, *args, **kwargs)  # the epoch's backup, where save_freq is "epoch"
        optimizer = getattr(self.model, "optimizer", None)
        if draining.is_set() and optimizer is not None:  # drained on the epoch's last batch
            if self.save_freq != "epoch":
                self._save_model()
            _stop_drained(int(optimizer.iterations))

    @functools.wraps(batch_end)
    def on_train_batch_end(self: Any, batch: int, *args: Any, **kwargs: Any) -> None:
        batch_end(self, batch, *args, **kwargs)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None:
            _first_step_done(int(optimizer.iterations))
        if not draining.is_set():
            return
        if optimizer is None or not latest.get("one_pass") or "began" not in latest:
            autosave.say("drained: Keras resumes this run only at an epoch's start; the last "
                         "backup stands")
            raise SystemExit(autosave.DRAINED)
        trained = latest.get("skipped", 0) + batch + 1
        if trained >= latest["batches"]:
            return  # the epoch's last batch: backed up as the epoch ends (on_epoch_end)
        # Backed up as of the epoch running (Keras resumes at its start), with the batches
        # of it trained, which a resumed attempt's pass skips.
        self._campugrid_mid_epoch = {"skip": trained, "began": _plain(latest["began"])}
        self._current_epoch = getattr(self, "_campugrid_epoch", self._current_epoch)
        self._save_model()
        _stop_drained(int(optimizer.iterations))

    backup_cls._save_model, backup_cls._load_model = _save_model, _load_model
    backup_cls.__init__, backup_cls.on_train_batch_end = __init__, on_train_batch_end
    backup_cls.on_train_begin, backup_cls.on_train_end = on_train_begin, on_train_end
    backup_cls.on_epoch_begin, backup_cls.on_epoch_end = on_epoch_begin, on_epoch_end


def _keras_passes(latest: dict[str, Any], resume: dict[str, Any]) -> bool:
    """Keras on PyTorch makes a DataLoader for each pass over the training data (its epoch
    iterator's `_get_iterator`): note the random states each pass begins with; a resumed
    attempt's first pass begins with those of the drained one's and skips the batches it had
    trained. Whether Keras could be hooked so (its PyTorch backend, as known here)."""
    try:
        if importlib.import_module("keras.src.backend.config").backend() != "torch":
            return False
        epochs_cls = importlib.import_module("keras.src.backend.torch.trainer").TorchEpochIterator
        _needs(epochs_cls, "_get_iterator")
    except Exception:
        return False
    get_iterator = epochs_cls._get_iterator

    class GoesOn:
        """The pass, the skipped batches drawn already; Keras's count of the epoch's steps
        is moved on by as many, so that the epoch ends where it would have."""

        def __init__(self, batches: Any, epochs: Any, skipped: int) -> None:
            self.batches, self.epochs, self.skipped = batches, epochs, skipped

        def __iter__(self) -> GoesOn:
            return self

        def __next__(self) -> Any:
            if self.skipped:  # Keras set its count to 0 after it made this iterator
                self.epochs._steps_seen += self.skipped
                self.skipped = 0
            return next(self.batches)

    class Resumed:
        def __init__(self, loader: Any, epochs: Any, skip: int, rng: dict[str, Any]) -> None:
            self.loader, self.epochs, self.skip, self.rng = loader, epochs, skip, rng

        def __iter__(self) -> GoesOn:
            batches = iter(self.loader)
            _skip(batches, self.skip)
            set_rng_states(self.rng)
            return GoesOn(batches, self.epochs, self.skip)

    @functools.wraps(get_iterator)
    def _get_iterator(self: Any) -> Any:
        if not latest.pop("next_is_training", False):
            return get_iterator(self)  # evaluate, predict, or the next pass made early
        batches = getattr(self, "_num_batches", None)
        latest.update(batches=batches, one_pass=getattr(self, "steps_per_epoch", 0) is None
                      and isinstance(batches, int)
                      and isinstance(getattr(self, "_steps_seen", None), int))
        if "skip" not in resume:
            latest["began"] = rng_states()
            return get_iterator(self)
        began, skip, rng = resume.pop("began"), resume.pop("skip"), resume.pop("rng")
        resume.clear()
        set_rng_states(began)
        latest.update(began=began, skipped=skip)
        return Resumed(get_iterator(self), self, skip, rng)

    epochs_cls._get_iterator = _get_iterator
    return True


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
