use super::*;
use prost::Message;

fn layout() -> KvLayout {
    KvLayout {
        dtype: DType::Bf16,
        num_layers: 32,
        block_size: 16,
        kv_heads_per_rank: 2,
        head_dim: 128,
        tp_size: 4,
        model_fingerprint: "fp-123".into(),
        kind: KvKind::KeyValue,
    }
}

fn card(kv_layout: Option<KvLayout>) -> NodeCard {
    NodeCard {
        id: NodeId::new("decode-0"),
        role: Role::Decode,
        cluster: "prod".into(),
        model_id: "llama".into(),
        model_fingerprint: "fp-123".into(),
        kv_layout,
        tp_size: 4,
        addresses: NodeAddresses {
            grpc: "10.0.0.2:7000".into(),
            http: Some("10.0.0.2:9000".into()),
            ucx_worker: Some("abcd".into()),
        },
        capacity: NodeCapacity {
            kv_blocks_total: 100,
            kv_blocks_free: 40,
            max_running_requests: 64,
            running_requests: 3,
            queued_requests: 1,
        },
        version: "0.1.0".into(),
        started_at_ms: 1_700_000_000_000,
        colocated: false,
        sglang: None,
        draining: false,
    }
}

/// Core -> wire -> bytes -> wire -> core.
fn through_bytes<M: Message + Default>(m: &M) -> M {
    M::decode(m.encode_to_vec().as_slice()).expect("decodes what it encoded")
}

#[test]
fn roles_round_trip_and_unspecified_is_an_error() {
    for r in [Role::Prefill, Role::Decode, Role::Router, Role::All] {
        let wire = v1::Role::from(r) as i32;
        assert_eq!(role_from_wire("role", wire).unwrap(), r);
        assert_eq!(role_filter_from_wire("role", wire).unwrap(), Some(r));
    }
    assert_eq!(
        role_from_wire("role", 0),
        Err(ConvertError::Unspecified { field: "role" })
    );
    assert_eq!(role_filter_from_wire("role", 0).unwrap(), None);
    assert_eq!(
        role_from_wire("node.role", 99),
        Err(ConvertError::UnknownEnumValue {
            field: "node.role",
            value: 99
        })
    );
    assert!(role_filter_from_wire("role", -1).is_err());
}

#[test]
fn finish_reasons_round_trip() {
    for f in [
        FinishReason::Stop,
        FinishReason::Length,
        FinishReason::Abort,
        FinishReason::Error,
    ] {
        assert_eq!(
            finish_reason_from_wire(finish_reason_to_wire(Some(f))).unwrap(),
            Some(f)
        );
        assert_eq!(
            FinishReason::try_from(v1::FinishReason::from(f)).unwrap(),
            f
        );
    }
    assert_eq!(
        finish_reason_from_wire(finish_reason_to_wire(None)).unwrap(),
        None
    );
    assert!(matches!(
        finish_reason_from_wire(42),
        Err(ConvertError::UnknownEnumValue { value: 42, .. })
    ));
    assert!(FinishReason::try_from(v1::FinishReason::Unspecified).is_err());
}

#[test]
fn error_kinds_round_trip_and_map_to_grpc_codes() {
    let all = [
        ErrorKind::InvalidRequest,
        ErrorKind::ContextLengthExceeded,
        ErrorKind::Unauthenticated,
        ErrorKind::PermissionDenied,
        ErrorKind::Overloaded,
        ErrorKind::Unavailable,
        ErrorKind::Retryable,
        ErrorKind::Timeout,
        ErrorKind::Cancelled,
        ErrorKind::Internal,
    ];
    for k in all {
        let msg = error_message(k, "boom");
        assert_eq!(
            error_from_wire(&through_bytes(&msg)),
            (k, "boom".to_string())
        );
        let status = tonic::Status::new(grpc_code(k), "x");
        let back = kind_of_status(&status);
        // Codes are coarser than kinds; the class survives.
        assert_eq!(grpc_code(back), grpc_code(k));
    }
    let unknown = v1::Error {
        kind: 1234,
        message: "m".into(),
    };
    assert_eq!(error_from_wire(&unknown).0, ErrorKind::Internal);
    let e = ConvertError::Missing { field: "x" };
    assert_eq!(status_of(&e).code(), tonic::Code::InvalidArgument);
}

#[test]
fn kv_layout_round_trips_and_rejects_bad_wire_values() {
    for dtype in [DType::F32, DType::F16, DType::Bf16] {
        let l = KvLayout { dtype, ..layout() };
        let wire = through_bytes(&v1::KvLayout::from(&l));
        assert_eq!(KvLayout::try_from(wire).unwrap(), l);
    }
    for kind in [KvKind::KeyValue, KvKind::Latent] {
        let l = KvLayout { kind, ..layout() };
        let wire = through_bytes(&v1::KvLayout::from(&l));
        assert_eq!(KvLayout::try_from(wire).unwrap(), l);
    }
    let mut unknown_kind = v1::KvLayout::from(layout());
    unknown_kind.kind = 9;
    assert_eq!(
        KvLayout::try_from(&unknown_kind),
        Err(ConvertError::UnknownEnumValue {
            field: "kv_layout.kind",
            value: 9
        })
    );
    let mut bad = v1::KvLayout::from(layout());
    bad.dtype = 77;
    assert_eq!(
        KvLayout::try_from(&bad),
        Err(ConvertError::UnknownEnumValue {
            field: "kv_layout.dtype",
            value: 77
        })
    );
    bad.dtype = 0;
    assert!(matches!(
        KvLayout::try_from(&bad),
        Err(ConvertError::Unspecified { .. })
    ));
    let mut zero = v1::KvLayout::from(layout());
    zero.block_size = 0;
    assert!(matches!(
        KvLayout::try_from(zero),
        Err(ConvertError::Invalid {
            field: "kv_layout.block_size",
            ..
        })
    ));
}

#[test]
fn sampling_params_round_trip() {
    let p = SamplingParams {
        temperature: 0.0,
        top_p: 0.9,
        top_k: 40,
        min_p: 0.05,
        repetition_penalty: 1.1,
        presence_penalty: 0.5,
        frequency_penalty: -0.5,
        seed: Some(7),
        max_tokens: 128,
        stop: vec!["</s>".into(), "\n\n".into()],
        stop_token_ids: vec![2, 3],
        ignore_eos: true,
        logprobs: Some(5),
    };
    let wire = through_bytes(&v1::SamplingParams::from(&p));
    assert_eq!(SamplingParams::from(wire), p);
    // temperature 0 (greedy) must survive even though it is proto3's default value.
    assert!(SamplingParams::from(v1::SamplingParams::from(SamplingParams::greedy(3))).is_greedy());
}

#[test]
fn empty_sampling_params_mean_core_defaults() {
    let p = SamplingParams::from(v1::SamplingParams::default());
    assert_eq!(p, SamplingParams::default());
    assert!(p.validate().is_ok());
}

#[test]
fn token_logprobs_round_trip() {
    let t = TokenLogprob {
        token_id: 5,
        logprob: -0.25,
        top: vec![(5, -0.25), (9, -1.5)],
    };
    let wire = through_bytes(&v1::TokenLogprob::from(&t));
    assert_eq!(TokenLogprob::from(wire), t);
}

#[test]
fn node_cards_round_trip() {
    let colocated = NodeCard {
        id: NodeId::new("all-0"),
        role: Role::All,
        colocated: true,
        sglang: None,
        draining: false,
        ..card(Some(layout()))
    };
    for c in [card(Some(layout())), card(None), colocated] {
        let wire = through_bytes(&v1::NodeCard::from(&c));
        assert_eq!(wire.colocated, c.colocated);
        assert_eq!(NodeCard::try_from(wire).unwrap(), c);
    }
    // A card from an older sender (no field 12) reads as not colocated.
    let mut old = v1::NodeCard::from(card(Some(layout())));
    old.colocated = false;
    assert!(!NodeCard::try_from(through_bytes(&old)).unwrap().colocated);
}

#[test]
fn bad_node_cards_are_errors() {
    let good = v1::NodeCard::from(card(Some(layout())));

    let mut c = good.clone();
    c.role = 9;
    assert!(matches!(
        NodeCard::try_from(c),
        Err(ConvertError::UnknownEnumValue {
            field: "node_card.role",
            value: 9
        })
    ));

    let mut c = good.clone();
    c.role = 0;
    assert!(matches!(
        NodeCard::try_from(c),
        Err(ConvertError::Unspecified { .. })
    ));

    let mut c = good.clone();
    c.id = "a/b".into();
    assert!(matches!(
        NodeCard::try_from(c),
        Err(ConvertError::Invalid {
            field: "node_card.id",
            ..
        })
    ));

    let mut c = good.clone();
    c.addresses = None;
    assert_eq!(
        NodeCard::try_from(c),
        Err(ConvertError::Missing {
            field: "node_card.addresses"
        })
    );

    let mut c = good;
    if let Some(l) = c.kv_layout.as_mut() {
        l.dtype = 50;
    }
    assert!(NodeCard::try_from(c).is_err());
}

#[test]
fn garbage_bytes_do_not_panic() {
    // Truncated or random input is a decode error, never a panic.
    let bytes = v1::NodeCard::from(card(Some(layout()))).encode_to_vec();
    for cut in 0..bytes.len() {
        let _ = v1::NodeCard::decode(&bytes[..cut]);
    }
    assert!(v1::NodeCard::decode([0xffu8, 0xff, 0xff].as_slice()).is_err());
}

#[test]
fn descriptor_set_names_both_services() {
    let fds = prost_types::FileDescriptorSet::decode(crate::FILE_DESCRIPTOR_SET).unwrap();
    let services: Vec<String> = fds
        .file
        .iter()
        .filter(|f| f.package() == "pdnode.v1")
        .flat_map(|f| f.service.iter().map(|s| s.name().to_string()))
        .collect();
    assert!(services.contains(&"Inference".to_string()), "{services:?}");
    assert!(services.contains(&"Node".to_string()), "{services:?}");
}

#[test]
fn sampler_state_round_trips_through_the_wire_with_its_128_bit_position() {
    for word_pos in [
        0u128,
        1,
        u128::from(u64::MAX),
        u128::from(u64::MAX) + 5,
        1 << 67,
    ] {
        let s = SamplerState {
            seed: 0xdead_beef_u64,
            word_pos,
        };
        let wire = through_bytes(&v1::SamplerState::from(s));
        assert_eq!(SamplerState::from(wire), s);
    }
    // Decode without the field (an older peer): no sampler state.
    let r = through_bytes(&v1::DecodeRequest::default());
    assert!(r.sampler.is_none());
}

#[test]
fn accounting_round_trips_with_its_step_times_and_drops_a_malformed_histogram() {
    let mut a = pdnode_core::Accounting {
        kv_blocks_free: 7,
        engine_preemptions_total: 3,
        ..Default::default()
    };
    a.engine_step_decode
        .observe(std::time::Duration::from_millis(4));
    a.engine_step_prefill
        .observe(std::time::Duration::from_millis(40));
    let wire = v1::Accounting::from(&a);
    assert_eq!(pdnode_core::Accounting::from(wire.clone()), a);
    // Counts of another bucket layout: dropped whole, the rest of the report kept.
    let mut bad = wire;
    if let Some(t) = bad.engine_step_decode.as_mut() {
        t.le.pop();
    }
    let back = pdnode_core::Accounting::from(bad);
    assert_eq!(back.engine_step_decode, pdnode_core::StepTimes::default());
    assert_eq!(back.engine_step_prefill, a.engine_step_prefill);
    assert_eq!(back.engine_preemptions_total, 3);
}
