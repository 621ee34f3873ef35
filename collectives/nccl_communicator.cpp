// NCCL backend: being written.
