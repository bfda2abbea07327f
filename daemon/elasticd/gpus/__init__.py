"""GPUs as schedulable resources: the node's inventory, the devices each job holds, their health."""
