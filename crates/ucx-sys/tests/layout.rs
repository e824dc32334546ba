//! The hand-written declarations match the C compiler's view of the UCX headers
//! (`layout/expected-1.13.txt`, written by `layout/check.sh`).

use std::collections::HashMap;
use std::mem::{offset_of, size_of};
use ucx_sys::ffi::*;

fn expected() -> HashMap<String, i64> {
    let text = include_str!("../layout/expected-1.13.txt");
    text.lines()
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            let (kind, name, value) = (it.next()?, it.next()?, it.next()?);
            Some((format!("{kind} {name}"), value.parse().ok()?))
        })
        .collect()
}

#[test]
fn struct_sizes_and_offsets_match_the_headers() {
    let e = expected();
    let mut checked = 0;
    let mut check = |key: &str, got: i64| {
        let want = *e
            .get(key)
            .unwrap_or_else(|| panic!("{key} missing from expected file"));
        assert_eq!(got, want, "{key}");
        checked += 1;
    };
    macro_rules! s {
        ($t:ty) => {
            check(concat!("size ", stringify!($t)), size_of::<$t>() as i64)
        };
    }
    macro_rules! o {
        ($t:ty, $f:ident) => {
            check(
                concat!("offset ", stringify!($t), ".", stringify!($f)),
                offset_of!($t, $f) as i64,
            )
        };
    }
    s!(ucs_status_t);
    s!(ucs_cpu_set_t);
    s!(ucp_params_t);
    o!(ucp_params_t, features);
    o!(ucp_params_t, mt_workers_shared);
    o!(ucp_params_t, name);
    s!(ucp_worker_params_t);
    o!(ucp_worker_params_t, thread_mode);
    o!(ucp_worker_params_t, events);
    o!(ucp_worker_params_t, event_fd);
    o!(ucp_worker_params_t, client_id);
    s!(ucp_ep_params_t);
    o!(ucp_ep_params_t, err_mode);
    o!(ucp_ep_params_t, err_handler);
    o!(ucp_ep_params_t, flags);
    o!(ucp_ep_params_t, sockaddr);
    o!(ucp_ep_params_t, name);
    s!(ucp_mem_map_params_t);
    o!(ucp_mem_map_params_t, prot);
    o!(ucp_mem_map_params_t, memory_type);
    s!(ucp_mem_attr_t);
    o!(ucp_mem_attr_t, address);
    o!(ucp_mem_attr_t, mem_type);
    s!(ucp_request_param_t);
    o!(ucp_request_param_t, cb);
    o!(ucp_request_param_t, datatype);
    o!(ucp_request_param_t, memory_type);
    o!(ucp_request_param_t, memh);
    s!(ucp_am_recv_param_t);
    o!(ucp_am_recv_param_t, reply_ep);
    s!(ucp_am_handler_param_t);
    o!(ucp_am_handler_param_t, id);
    o!(ucp_am_handler_param_t, flags);
    o!(ucp_am_handler_param_t, cb);
    o!(ucp_am_handler_param_t, arg);
    assert_eq!(checked, 35);
}

#[test]
fn constants_match_the_headers() {
    let e = expected();
    let c = |n: &str| {
        *e.get(&format!("const {n}"))
            .unwrap_or_else(|| panic!("{n} missing"))
    };
    assert_eq!(c("UCS_ERR_LAST"), UCS_ERR_LAST as i64);
    assert_eq!(c("UCS_ERR_BUSY"), UCS_ERR_BUSY as i64);
    assert_eq!(c("UCS_INPROGRESS"), UCS_INPROGRESS as i64);
    assert_eq!(c("UCP_MEM_MAP_ALLOCATE"), UCP_MEM_MAP_ALLOCATE as i64);
    assert_eq!(
        c("UCP_MEM_ATTR_FIELD_ADDRESS"),
        UCP_MEM_ATTR_FIELD_ADDRESS as i64
    );
    assert_eq!(
        c("UCP_MEM_ATTR_FIELD_LENGTH"),
        UCP_MEM_ATTR_FIELD_LENGTH as i64
    );
    assert_eq!(c("UCS_MEMORY_TYPE_HOST"), UCS_MEMORY_TYPE_HOST as i64);
    assert_eq!(c("UCS_MEMORY_TYPE_CUDA"), UCS_MEMORY_TYPE_CUDA as i64);
    assert_eq!(
        c("UCP_ERR_HANDLING_MODE_PEER"),
        UCP_ERR_HANDLING_MODE_PEER as i64
    );
    assert_eq!(c("UCS_THREAD_MODE_SINGLE"), UCS_THREAD_MODE_SINGLE as i64);
    assert_eq!(c("UCP_FEATURE_RMA"), UCP_FEATURE_RMA as i64);
    assert_eq!(c("UCP_FEATURE_AM"), UCP_FEATURE_AM as i64);
    assert_eq!(
        c("UCP_AM_HANDLER_PARAM_FIELD_ID"),
        UCP_AM_HANDLER_PARAM_FIELD_ID as i64
    );
    assert_eq!(
        c("UCP_AM_HANDLER_PARAM_FIELD_FLAGS"),
        UCP_AM_HANDLER_PARAM_FIELD_FLAGS as i64
    );
    assert_eq!(
        c("UCP_AM_HANDLER_PARAM_FIELD_CB"),
        UCP_AM_HANDLER_PARAM_FIELD_CB as i64
    );
    assert_eq!(
        c("UCP_AM_HANDLER_PARAM_FIELD_ARG"),
        UCP_AM_HANDLER_PARAM_FIELD_ARG as i64
    );
    assert_eq!(c("UCP_AM_FLAG_WHOLE_MSG"), UCP_AM_FLAG_WHOLE_MSG as i64);
    assert_eq!(c("UCP_AM_SEND_FLAG_REPLY"), UCP_AM_SEND_FLAG_REPLY as i64);
    assert_eq!(c("UCP_AM_SEND_FLAG_EAGER"), UCP_AM_SEND_FLAG_EAGER as i64);
    assert_eq!(
        c("UCP_AM_RECV_ATTR_FIELD_REPLY_EP"),
        UCP_AM_RECV_ATTR_FIELD_REPLY_EP as i64
    );
    assert_eq!(
        c("UCP_AM_RECV_ATTR_FLAG_DATA"),
        UCP_AM_RECV_ATTR_FLAG_DATA as i64
    );
    assert_eq!(
        c("UCP_AM_RECV_ATTR_FLAG_RNDV"),
        UCP_AM_RECV_ATTR_FLAG_RNDV as i64
    );
    assert_eq!(c("UCS_ERR_UNSUPPORTED"), UCS_ERR_UNSUPPORTED as i64);
    assert_eq!(c("UCP_FEATURE_WAKEUP"), UCP_FEATURE_WAKEUP as i64);
    assert_eq!(c("UCP_WAKEUP_RMA"), UCP_WAKEUP_RMA as i64);
    assert_eq!(c("UCP_WAKEUP_TX"), UCP_WAKEUP_TX as i64);
    assert_eq!(c("UCP_WAKEUP_RX"), UCP_WAKEUP_RX as i64);
    assert_eq!(c("UCP_EP_CLOSE_FLAG_FORCE"), UCP_EP_CLOSE_FLAG_FORCE as i64);
    assert_eq!(
        c("UCP_OP_ATTR_FIELD_MEMORY_TYPE"),
        UCP_OP_ATTR_FIELD_MEMORY_TYPE as i64
    );
    assert_eq!(c("UCP_OP_ATTR_FIELD_FLAGS"), UCP_OP_ATTR_FIELD_FLAGS as i64);
    assert_eq!(
        c("UCP_EP_PARAM_FIELD_REMOTE_ADDRESS"),
        UCP_EP_PARAM_FIELD_REMOTE_ADDRESS as i64
    );
    assert_eq!(
        c("UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE"),
        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE as i64
    );
    assert_eq!(
        c("UCP_EP_PARAM_FIELD_ERR_HANDLER"),
        UCP_EP_PARAM_FIELD_ERR_HANDLER as i64
    );
    assert_eq!(
        c("UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE"),
        UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE as i64
    );
    assert_eq!(
        c("UCP_WORKER_PARAM_FIELD_EVENTS"),
        UCP_WORKER_PARAM_FIELD_EVENTS as i64
    );
}
