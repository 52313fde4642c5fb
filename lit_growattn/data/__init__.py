"""Data modules: every loader yields (inputs, labels) LongTensors of shape (B, T), labels -100 where no loss is taken."""

from lit_growattn.data.arithmetic import ArithmeticDataModule
from lit_growattn.data.instruct import InstructDataModule
from lit_growattn.data.mqar import MQARDataModule
from lit_growattn.data.recall import FusedRecallDataModule
from lit_growattn.data.text import TextDataModule

__all__ = ["ArithmeticDataModule", "FusedRecallDataModule", "InstructDataModule", "MQARDataModule", "TextDataModule"]
