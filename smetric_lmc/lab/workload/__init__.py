"""Workloads for the simulator: trace loaders, the synthetic agentic generator, trace analysis."""

from smetric_lmc.lab.workload.analyze import AnalysisReport, analyze, format_report, plot_report
from smetric_lmc.lab.workload.jsonl import load_bailian, load_mooncake
from smetric_lmc.lab.workload.loaders import detect_format, load_any
from smetric_lmc.lab.workload.model import TraceRequest, TraceSession, Workload
from smetric_lmc.lab.workload.native import load_native, save_native
from smetric_lmc.lab.workload.synthetic import WEKA_FIT, SyntheticParams, synthetic
from smetric_lmc.lab.workload.weka import load_weka

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
