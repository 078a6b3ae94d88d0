# Shared settings of the four-node peer-pool deployment; `source` it on every machine
# after setting SELF to this machine's IP. Edit the values below first.
MODEL=${MODEL:-/path/to/your/model}
NODE1_IP=${NODE1_IP:-10.0.0.1}
NODE2_IP=${NODE2_IP:-10.0.0.2}
NODE3_IP=${NODE3_IP:-10.0.0.3}
NODE4_IP=${NODE4_IP:-10.0.0.4}
DEVS=${DEVS:-mlx5_bond_1,mlx5_bond_2,mlx5_bond_3,mlx5_bond_4,mlx5_bond_5,mlx5_bond_6,mlx5_bond_7,mlx5_bond_8}
TOKEN=${TOKEN:-change-me-shared-secret}     # the same on all four: nodes without it are refused
TP=${TP:-1}
DISC="$NODE1_IP:31998,$NODE2_IP:31998"      # two seeds: either one is enough to join
: "${SELF:?set SELF to this machine's IP}"

PC='{"backend_name":"kvconnect","module_path":"kvconnect.connectors.engines.sglang_hicache","class_name":"KVConnectStorage",'\
'"interface_v1":1,"store":"peer_rdma","discovery_addr":"'$DISC'","protocol":"rdma","device_names":"'$DEVS'",'\
'"local_hostname":"'$SELF'","bind_host":"'$SELF'","global_segment_size":"16gb",'\
'"disk_path":"/data/kvconnect-peer/","disk_size":"100gb","auth_token":"'$TOKEN'",'\
'"metrics_port":31997,"metrics_host":"'$SELF'"}'
export MODEL NODE1_IP NODE2_IP NODE3_IP NODE4_IP DEVS TOKEN TP DISC SELF PC
