//! Which GPUs a CUDA backend binds: rank `r` of a tensor-parallel group runs on the `r`-th
//! listed ordinal (`engine.gpus`), in the order given, gaps allowed. Pure functions, so the
//! rules are tested on hosts without a GPU.

use crate::CudaError;
use std::collections::HashSet;

/// The ordinals a backend binds when `engine.gpus` lists none (`backend = "auto"` resolving to
/// CUDA): the first `tensor_parallel` devices (validation allows an empty list only at TP = 1).
pub fn gpus_from_config(listed: &[u32], tensor_parallel: u32) -> Vec<u32> {
    if listed.is_empty() {
        (0..tensor_parallel.max(1)).collect()
    } else {
        listed.to_vec()
    }
}

/// `gpus` has exactly `tensor_parallel` distinct ordinals (one per rank; never a silent subset).
pub fn check_gpu_list(gpus: &[u32], tensor_parallel: u32) -> Result<(), CudaError> {
    let tp = tensor_parallel.max(1) as usize;
    if gpus.len() != tp {
        return Err(CudaError::Unsupported {
            reason: format!(
                "tensor_parallel = {tp} binds exactly {tp} GPU(s), one per rank, but {} are listed \
                 ({gpus:?}); run one node per tensor-parallel group",
                gpus.len()
            ),
        });
    }
    let mut seen = HashSet::with_capacity(gpus.len());
    if let Some(g) = gpus.iter().find(|g| !seen.insert(**g)) {
        return Err(CudaError::Unsupported {
            reason: format!("GPU {g} is listed twice in {gpus:?}"),
        });
    }
    Ok(())
}

/// Every listed ordinal exists on a host with `device_count` devices; else the first that does
/// not, as [`CudaError::NoDevice`].
pub fn check_present(gpus: &[u32], device_count: u32) -> Result<(), CudaError> {
    match gpus.iter().find(|&&g| g >= device_count) {
        Some(&ordinal) => Err(CudaError::NoDevice {
            ordinal,
            count: device_count,
        }),
        None => Ok(()),
    }
}

/// The backend's name for these GPUs: `cuda:4` (one), `cuda:4-7` (ascending and contiguous),
/// else every ordinal in rank order, `cuda:1,0` / `cuda:0,2`.
pub fn device_label(gpus: &[u32]) -> String {
    let contiguous = gpus.len() > 1 && gpus.windows(2).all(|w| w[0].checked_add(1) == Some(w[1]));
    match gpus {
        [] => "cuda:none".to_string(),
        [g] => format!("cuda:{g}"),
        [first, .., last] if contiguous => format!("cuda:{first}-{last}"),
        _ => {
            let list: Vec<String> = gpus.iter().map(u32::to_string).collect();
            format!("cuda:{}", list.join(","))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_list_the_ordinals_in_rank_order() {
        assert_eq!(device_label(&[0]), "cuda:0");
        assert_eq!(device_label(&[4, 5, 6, 7]), "cuda:4-7");
        assert_eq!(device_label(&[0, 1]), "cuda:0-1");
        assert_eq!(device_label(&[1, 0]), "cuda:1,0");
        assert_eq!(device_label(&[0, 2]), "cuda:0,2");
        assert_eq!(device_label(&[4, 5, 7, 6]), "cuda:4,5,7,6");
        assert_eq!(device_label(&[3, 3]), "cuda:3,3");
        assert_eq!(
            device_label(&[u32::MAX - 1, u32::MAX]),
            format!("cuda:{}-{}", u32::MAX - 1, u32::MAX)
        );
        assert_eq!(device_label(&[]), "cuda:none");
    }

    #[test]
    fn the_list_must_have_one_distinct_gpu_per_rank() {
        check_gpu_list(&[4, 5, 6, 7], 4).unwrap();
        check_gpu_list(&[1, 0], 2).unwrap();
        check_gpu_list(&[0, 7], 2).unwrap();
        check_gpu_list(&[3], 1).unwrap();
        // tp 0 is treated as 1 (like the rest of the backend).
        check_gpu_list(&[3], 0).unwrap();
        for (gpus, tp) in [
            (&[0, 1, 2, 3][..], 2),
            (&[0][..], 2),
            (&[][..], 1),
            (&[0, 1][..], 1),
        ] {
            match check_gpu_list(gpus, tp) {
                Err(CudaError::Unsupported { reason }) => {
                    assert!(reason.contains("one node per"), "{reason}")
                }
                other => panic!("{gpus:?} tp {tp}: {other:?}"),
            }
        }
        match check_gpu_list(&[2, 2], 2) {
            Err(CudaError::Unsupported { reason }) => assert!(reason.contains("GPU 2"), "{reason}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_missing_ordinal_is_named() {
        check_present(&[1, 0], 2).unwrap();
        assert!(matches!(
            check_present(&[0, 7], 2),
            Err(CudaError::NoDevice {
                ordinal: 7,
                count: 2
            })
        ));
        assert!(matches!(
            check_present(&[9, 8], 8),
            Err(CudaError::NoDevice {
                ordinal: 9,
                count: 8
            })
        ));
        assert!(matches!(
            check_present(&[0], 0),
            Err(CudaError::NoDevice {
                ordinal: 0,
                count: 0
            })
        ));
    }

    #[test]
    fn options_from_config_keep_the_listed_order() {
        use crate::CudaOptions;
        let mut e = pdnode_core::config::EngineConfig {
            gpus: vec![6, 4],
            tensor_parallel: 2,
            ..Default::default()
        };
        let o = CudaOptions::from_config(&e);
        assert_eq!((o.gpus.as_slice(), o.tensor_parallel), (&[6, 4][..], 2));
        check_gpu_list(&o.gpus, o.tensor_parallel).unwrap();
        e.gpus.clear();
        e.tensor_parallel = 1;
        assert_eq!(CudaOptions::from_config(&e).gpus, vec![0]);
    }

    #[test]
    fn an_empty_list_means_the_first_devices() {
        assert_eq!(gpus_from_config(&[], 1), vec![0]);
        assert_eq!(gpus_from_config(&[], 0), vec![0]);
        assert_eq!(gpus_from_config(&[], 2), vec![0, 1]);
        assert_eq!(gpus_from_config(&[4, 5], 2), vec![4, 5]);
        assert_eq!(gpus_from_config(&[1, 0], 2), vec![1, 0]);
    }
}
