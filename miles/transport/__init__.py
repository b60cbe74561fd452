"""Weight sync trainer -> rollout engines, below both (miles/rollout/, miles/trainer/ import it).

`protocol`: the `WeightTransport` protocol, `TransportName` (`rollout.weight_sync`) and the registry
`build_transport`. The transports: `object_store` (get_weights -> update_weights through the handles;
in-process the flat device copy of `flat`), `broadcast` (a gloo / NCCL group of the trainer and the
engines, in buckets), `shared_memory` (one buffer the engines map: /dev/shm on the CPU, a CUDA IPC
handle on a GPU); `collective`: the setup and restart detection the last two share. `checksum`: the
SHA-256 both sides compute, the rollout dtypes, `WeightSyncError`. `flat.FlatWeights`: one flat
buffer per side and its device checksum. `ray_tensors`: how tensors of every dtype (float8, packed
int4) cross Ray. `device`: the device helpers engine and trainer share."""
