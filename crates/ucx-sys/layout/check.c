/* Sizes and offsets of the UCP declarations ucx-sys writes by hand (see check.sh). */
#include <ucp/api/ucp.h>
#include <stdio.h>
#include <stddef.h>
#define S(t) printf("size %s %zu\n", #t, sizeof(t))
#define O(t,f) printf("offset %s.%s %zu\n", #t, #f, offsetof(t,f))
int main(){
S(ucs_status_t); S(ucs_thread_mode_t); S(ucs_memory_type_t); S(ucp_err_handling_mode_t); S(ucs_cpu_set_t);
S(ucp_params_t); O(ucp_params_t,features); O(ucp_params_t,mt_workers_shared); O(ucp_params_t,name);
S(ucp_worker_params_t); O(ucp_worker_params_t,thread_mode); O(ucp_worker_params_t,events); O(ucp_worker_params_t,event_fd); O(ucp_worker_params_t,client_id);
S(ucp_ep_params_t); O(ucp_ep_params_t,err_mode); O(ucp_ep_params_t,err_handler); O(ucp_ep_params_t,flags); O(ucp_ep_params_t,sockaddr); O(ucp_ep_params_t,name);
S(ucp_mem_map_params_t); O(ucp_mem_map_params_t,prot); O(ucp_mem_map_params_t,memory_type);
S(ucp_mem_attr_t); O(ucp_mem_attr_t,address); O(ucp_mem_attr_t,mem_type);
S(ucp_request_param_t); O(ucp_request_param_t,cb); O(ucp_request_param_t,datatype); O(ucp_request_param_t,memory_type); O(ucp_request_param_t,memh);
S(ucp_am_recv_param_t); O(ucp_am_recv_param_t,reply_ep);
S(ucp_am_handler_param_t); O(ucp_am_handler_param_t,id); O(ucp_am_handler_param_t,flags); O(ucp_am_handler_param_t,cb); O(ucp_am_handler_param_t,arg);
#define C(n) printf("const %s %ld\n", #n, (long)(n))
C(UCS_ERR_LAST); C(UCS_MEMORY_TYPE_HOST); C(UCS_MEMORY_TYPE_CUDA); C(UCP_ERR_HANDLING_MODE_PEER); C(UCS_THREAD_MODE_SINGLE);
C(UCP_FEATURE_RMA); C(UCP_FEATURE_WAKEUP); C(UCP_WAKEUP_RMA); C(UCP_WAKEUP_TX); C(UCP_WAKEUP_RX); C(UCP_EP_CLOSE_FLAG_FORCE);
C(UCP_OP_ATTR_FIELD_MEMORY_TYPE); C(UCP_OP_ATTR_FIELD_FLAGS); C(UCP_EP_PARAM_FIELD_REMOTE_ADDRESS); C(UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE); C(UCP_EP_PARAM_FIELD_ERR_HANDLER);
C(UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE); C(UCP_WORKER_PARAM_FIELD_EVENTS); C(UCS_ERR_BUSY); C(UCS_INPROGRESS); C(UCP_MEM_MAP_ALLOCATE); C(UCP_MEM_ATTR_FIELD_ADDRESS); C(UCP_MEM_ATTR_FIELD_LENGTH);
C(UCP_FEATURE_AM); C(UCP_AM_HANDLER_PARAM_FIELD_ID); C(UCP_AM_HANDLER_PARAM_FIELD_FLAGS); C(UCP_AM_HANDLER_PARAM_FIELD_CB); C(UCP_AM_HANDLER_PARAM_FIELD_ARG); C(UCP_AM_FLAG_WHOLE_MSG);
C(UCP_AM_SEND_FLAG_REPLY); C(UCP_AM_SEND_FLAG_EAGER); C(UCP_AM_RECV_ATTR_FIELD_REPLY_EP); C(UCP_AM_RECV_ATTR_FLAG_DATA); C(UCP_AM_RECV_ATTR_FLAG_RNDV); C(UCS_ERR_UNSUPPORTED);
}
