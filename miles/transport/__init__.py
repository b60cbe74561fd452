"""Weight sync transports. `flat.FlatWeights`: in-process sync as one flat buffer per side, copied
device to device and checked by a device checksum (miles/orchestrate/weight_sync.py keeps the
object-store path: host state dicts and SHA-256). `ray_tensors`: how tensors of every dtype (float8,
packed int4) cross Ray, as raw bytes plus dtype and shape. `broadcast`: a gloo / NCCL group of the
trainer and the engines, in buckets. `shared_memory`: colocated components, one buffer the engines
map (/dev/shm on the CPU, a CUDA IPC handle on a GPU)."""
