"""Draft heads: EAGLE-2 (dense), Jakiro (MoE), Gumiho (MLP heads) and released EAGLE-3 heads, their
configuration, files and the released formats they load from and save to."""
from jakiro_ext.models.heads.config import DraftConfig
from jakiro_ext.models.heads.draft_head import DraftHead
from jakiro_ext.models.heads.eagle3 import Eagle3Head  # registers the eagle3 format's loader
from jakiro_ext.models.heads.step import DraftStep

__all__ = ["DraftConfig", "DraftHead", "DraftStep", "Eagle3Head"]
