"""transformers helpers: tiny model families, an exportable decode step, reify, and NNEF
preparation with the dynamic-length (symbolic S) export."""

from gdn_fx.hf.configs import FAMILIES, tiny_config, tiny_model
from gdn_fx.hf.decode import DecodeStep, hf_continue
from gdn_fx.hf.dropins import Reified, UnsupportedModel, reify
from gdn_fx.hf.nnef import check_dynamic, export_dynamic, export_nnef_dynamic, prepare_for_nnef
from gdn_fx.hf.states import StateSpec

__all__ = [
    "FAMILIES", "DecodeStep", "Reified", "StateSpec", "UnsupportedModel", "check_dynamic",
    "export_dynamic", "export_nnef_dynamic", "hf_continue", "prepare_for_nnef", "reify",
    "tiny_config", "tiny_model",
]
