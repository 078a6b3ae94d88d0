#!/usr/bin/env bash
# Sourced by the other scripts: store_options STORE -> the store's options as JSON members
# (used both as the native connector's kv_connector_extra_config and as the LMCache
# plugin's adapter_params). Environment knobs per store:
#   memory    CAPACITY (16gb)                       pages in the process (one vLLM / one LMCache server)
#   hf3fs     KV_DIR (/3fs/kvconnect) FILE_SIZE (64gb) META_URL (unset: one process per file)
#   mooncake  MOONCAKE_MASTER (127.0.0.1:50051) MOONCAKE_PROTOCOL (tcp) MOONCAKE_GLOBAL_SEGMENT_SIZE (4gb)
#   peer_rdma PEER_SEED (127.0.0.1:31998) PEER_SEGMENT (16gb) PEER_PROTOCOL (rdma: TCP where no NIC)
store_options() {
  case "$1" in
    memory)   echo "\"store\":\"memory\",\"capacity\":\"${CAPACITY:-16gb}\"" ;;
    hf3fs)    local dir="${KV_DIR:-/3fs/kvconnect}"; mkdir -p "$dir"
              local o="\"store\":\"hf3fs\",\"file_path_prefix\":\"$dir/${HF3FS_FILE:-vllm}\",\"file_size\":\"${FILE_SIZE:-64gb}\",\"numjobs\":8,\"entries\":8"
              [[ -n "${META_URL:-}" ]] && o="$o,\"metadata_server_url\":\"$META_URL\""
              echo "$o" ;;
    mooncake) echo "\"store\":\"mooncake\",\"master_server_address\":\"${MOONCAKE_MASTER:-127.0.0.1:50051}\",\"metadata_server\":\"P2PHANDSHAKE\",\"local_hostname\":\"${MOONCAKE_LOCAL_HOSTNAME:-127.0.0.1}\",\"protocol\":\"${MOONCAKE_PROTOCOL:-tcp}\",\"global_segment_size\":\"${MOONCAKE_GLOBAL_SEGMENT_SIZE:-4gb}\"" ;;
    peer_rdma) echo "\"store\":\"peer_rdma\",\"discovery_addr\":\"${PEER_SEED:-127.0.0.1:31998}\",\"protocol\":\"${PEER_PROTOCOL:-rdma}\",\"local_hostname\":\"${PEER_HOSTNAME:-127.0.0.1}\",\"global_segment_size\":\"${PEER_SEGMENT:-16gb}\"" ;;
    *) echo "STORE must be memory, hf3fs, mooncake or peer_rdma" >&2; return 2 ;;
  esac
}
