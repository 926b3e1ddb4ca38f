"""How groups communicate: the collectives protocol and its plain implementation (collectives), torch.distributed's
calls on both torch versions (dist_ops), mfsdp_ext's own NCCL communicator (native), NCCL symmetric memory
(symmetric/), and which ranks share a host (hosts)."""
