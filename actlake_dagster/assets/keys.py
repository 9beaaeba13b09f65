"""Asset keys and the tags every GPU step carries (so the same definitions run on a cluster)."""


import dagster as dg

MODEL_CHECKPOINT = dg.AssetKey("model_checkpoint")
MACHINE_SLICES = dg.AssetKey("machine_slices")
ACTIVATION_SHARDS = dg.AssetKey("activation_shards")
SAE_RUN = dg.AssetKey("sae_run")
SAE_CHECKPOINT = dg.AssetKey("sae_checkpoint")
INFERENCE_DUMP = dg.AssetKey("inference_dump")

GPU_POOL = "gpu"
#: GPU steps: one `nvidia.com/gpu` on Kubernetes (dagster-k8s reads this tag), the `gpu` Celery queue
GPU_OP_TAGS: dict[str, object] = {
    "dagster-k8s/config": {"container_config": {"resources": {"requests": {"nvidia.com/gpu": "1"},
                                                              "limits": {"nvidia.com/gpu": "1"}}}},
    "dagster-celery/queue": "gpu",
}
#: what changes a stored result's bytes when the library changes (bumped by hand)
CODE_VERSION = "actlake-graph-1"
