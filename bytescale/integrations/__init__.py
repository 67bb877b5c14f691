"""Integrations with the trainers people already run (needs ``transformers``; TRL optional).

:class:`HDPTrainer` is ``transformers.Trainer`` with hybrid data parallelism;
:class:`HDPTrainerMixin` adds it to any ``Trainer`` subclass (``class MySFT(HDPTrainerMixin,
SFTTrainer)``, or :func:`hdp_trainer` ``(SFTTrainer)``). See :mod:`.hf_trainer`.
"""
from .hf_data import HDPBatch, HDPTrainLoader, HFDocuments
from .hf_trainer import LOADER_STATE, HDPTrainer, HDPTrainerMixin, hdp_trainer

__all__ = ["HDPTrainer", "HDPTrainerMixin", "hdp_trainer", "HDPTrainLoader", "HDPBatch", "HFDocuments",
           "LOADER_STATE"]
