"""Weight sync transports. `flat.FlatWeights`: in-process sync as one flat buffer per side, copied
device to device and checked by a device checksum (miles/orchestrate/weight_sync.py keeps the
object-store path: host state dicts and SHA-256). `ray_tensors`: how tensors of every dtype (float8,
packed int4) cross Ray, as raw bytes plus dtype and shape."""
