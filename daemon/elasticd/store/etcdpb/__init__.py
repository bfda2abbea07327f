"""Generated gRPC stubs of the part of etcd's v3 API the store speaks natively
(protos/elasticd/store/etcdpb/lease.proto; made by scripts/gen_protos.sh)."""
