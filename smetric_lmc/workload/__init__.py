"""Workloads for the simulator: trace loaders, the synthetic agentic generator, trace analysis."""

from .analyze import AnalysisReport, analyze, format_report, plot_report
from .jsonl import load_bailian, load_mooncake
from .loaders import detect_format, load_any
from .model import TraceRequest, TraceSession, Workload
from .native import load_native, save_native
from .synthetic import WEKA_FIT, SyntheticParams, synthetic
from .weka import load_weka

__all__ = [
    "WEKA_FIT",
    "AnalysisReport",
    "SyntheticParams",
    "TraceRequest",
    "TraceSession",
    "Workload",
    "analyze",
    "detect_format",
    "format_report",
    "load_any",
    "load_bailian",
    "load_mooncake",
    "load_native",
    "load_weka",
    "plot_report",
    "save_native",
    "synthetic",
]
