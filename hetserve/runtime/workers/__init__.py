"""Worker processes and the links between endpoints: one process per device, the wire format, authenticated sockets, rendezvous and Ray placement."""

# how tensors move between workers (EngineConfig.device_channel, `serve --device-channel`): "off"
# (the socket), "auto" (a device channel between GPU workers: CUDA IPC on one GPU, NCCL between
# GPUs), "on" (gloo between CPU workers too: the same code path). Here, not in the engine's config,
# so the CLI offers the choices without importing torch.
DEVICE_CHANNELS = ("off", "auto", "on")
