"""The engine reads the upload pipeline only through its plan (`upload.plan.UploadPlan`): it
imports neither the pipeline nor its parts, and reads no attribute of it."""

import ast
import pathlib

ENGINE = pathlib.Path(__file__).resolve().parents[2] / "fedjax_pfedes" / "engine"
# What the engine may import of the upload layer: the plan, the settings it validates, the
# stage registry (the default config and its checks), the norm it reports and DP-SGD's
# accountant (a method's local training, not the pipeline).
ALLOWED = {"fedjax_pfedes.upload.plan", "fedjax_pfedes.upload.settings",
           "fedjax_pfedes.upload.stages", "fedjax_pfedes.upload.validation",
           "fedjax_pfedes.upload.privacy"}
PIPELINE_ATTRIBUTES = {"pipeline", "cfg", "stages", "report_keys", "streamed_clip_norm",
                       "client_facts", "keyless_client_side", "expected_in_scope"}


def pipeline_reads(source: str) -> list[str]:
    """What a module's source imports of the upload layer beyond `ALLOWED`, and the pipeline
    attributes it reads."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules = ([f"{node.module}.{a.name}" for a in node.names]
                       if node.module == "fedjax_pfedes.upload" else [node.module])
            found += [m for m in modules
                      if m.startswith("fedjax_pfedes.upload") and m not in ALLOWED]
        elif isinstance(node, ast.Attribute) and node.attr in PIPELINE_ATTRIBUTES:
            found.append(f".{node.attr}")
    return found


def test_the_engine_reads_the_upload_pipeline_only_through_its_plan():
    for path in sorted(ENGINE.glob("*.py")):
        assert pipeline_reads(path.read_text()) == [], path.name


def test_the_check_sees_a_pipeline_read():
    assert pipeline_reads("from fedjax_pfedes.upload.pipeline import UploadPipeline\n")
    assert pipeline_reads("from fedjax_pfedes.upload import streaming\n")
    assert pipeline_reads("x = ctx.pipeline.process\n")
    assert pipeline_reads("dp = plan.cfg.dp\n")
    assert not pipeline_reads("from fedjax_pfedes.upload.plan import UploadPlan\n")
