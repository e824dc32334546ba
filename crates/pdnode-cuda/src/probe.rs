//! Is CUDA usable here? Checked before any driver call: cudarc panics on the first driver call
//! when libcuda is absent, so [`probe`] looks for the library first.

use super::{CudaError, drv};
use pdnode_core::config::Backend as BackendKind;

/// What the probe found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaProbe {
    pub device_count: u32,
    /// `(ordinal, name, total memory bytes, compute capability)` per device.
    pub devices: Vec<(u32, String, usize, (i32, i32))>,
}

/// Looks for libcuda and the devices it sees. Never panics.
pub fn probe() -> Result<CudaProbe, CudaError> {
    // SAFETY: only tries to dlopen the library by its usual names; no symbol is called.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(CudaError::NoDriver);
    }
    cudarc::driver::result::init().map_err(drv("cuInit"))?;
    let count = cudarc::driver::result::device::get_count().map_err(drv("cuDeviceGetCount"))?;
    let mut devices = Vec::new();
    for i in 0..count {
        let dev = cudarc::driver::result::device::get(i).map_err(drv("cuDeviceGet"))?;
        let name = cudarc::driver::result::device::get_name(dev).map_err(drv("cuDeviceGetName"))?;
        // SAFETY: `dev` is a valid device handle from cuDeviceGet.
        let mem = unsafe { cudarc::driver::result::device::total_mem(dev) }
            .map_err(drv("cuDeviceTotalMem"))?;
        use cudarc::driver::sys::CUdevice_attribute as A;
        // SAFETY: as above; the attributes exist on every CUDA device.
        let cc = unsafe {
            (
                cudarc::driver::result::device::get_attribute(
                    dev,
                    A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                )
                .map_err(drv("cuDeviceGetAttribute"))?,
                cudarc::driver::result::device::get_attribute(
                    dev,
                    A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                )
                .map_err(drv("cuDeviceGetAttribute"))?,
            )
        };
        devices.push((i as u32, name, mem, cc));
    }
    Ok(CudaProbe {
        device_count: count as u32,
        devices,
    })
}

/// The backend a node runs after resolving `engine.backend`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendChoice {
    Cpu,
    Cuda,
    Mock,
}

/// Resolves `engine.backend` against this host: `auto` -> CUDA when a driver sees every GPU in
/// `gpus` (or at least one device when `gpus` is empty), else CPU; `cuda` without them -> error.
pub fn select_backend(kind: BackendKind, gpus: &[u32]) -> Result<BackendChoice, CudaError> {
    let usable = || -> Result<(), CudaError> {
        let p = probe()?;
        if p.device_count == 0 {
            return Err(CudaError::NoDevice {
                ordinal: 0,
                count: 0,
            });
        }
        if let Some(&g) = gpus.iter().find(|&&g| g >= p.device_count) {
            return Err(CudaError::NoDevice {
                ordinal: g,
                count: p.device_count,
            });
        }
        Ok(())
    };
    match kind {
        BackendKind::Cpu => Ok(BackendChoice::Cpu),
        BackendKind::Mock => Ok(BackendChoice::Mock),
        BackendKind::Cuda => usable().map(|()| BackendChoice::Cuda),
        BackendKind::Auto => Ok(match usable() {
            Ok(()) => BackendChoice::Cuda,
            Err(e) => {
                tracing::info!(reason = %e, "backend = auto: CUDA unusable, using the CPU backend");
                BackendChoice::Cpu
            }
        }),
    }
}

/// The PCI address of CUDA device `ordinal` as sysfs names it (`0000:19:00.0`, lower-case hex):
/// `/sys/bus/pci/devices/{it}` holds the device's `numa_node`.
pub fn pci_address(ordinal: u32) -> Result<String, CudaError> {
    // SAFETY: only tries to dlopen the library by its usual names; no symbol is called.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(CudaError::NoDriver);
    }
    cudarc::driver::result::init().map_err(drv("cuInit"))?;
    let dev = cudarc::driver::result::device::get(ordinal as i32).map_err(drv("cuDeviceGet"))?;
    use cudarc::driver::sys::CUdevice_attribute as A;
    let attr = |a| {
        // SAFETY: `dev` is a valid device handle from cuDeviceGet; the PCI attributes exist on
        // every CUDA device.
        unsafe { cudarc::driver::result::device::get_attribute(dev, a) }
            .map_err(drv("cuDeviceGetAttribute"))
    };
    let domain = attr(A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?;
    let bus = attr(A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?;
    let device = attr(A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?;
    Ok(format!("{domain:04x}:{bus:02x}:{device:02x}.0"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_and_mock_need_no_probe() {
        assert_eq!(
            select_backend(BackendKind::Cpu, &[]).unwrap(),
            BackendChoice::Cpu
        );
        assert_eq!(
            select_backend(BackendKind::Mock, &[0]).unwrap(),
            BackendChoice::Mock
        );
    }

    #[test]
    fn auto_and_cuda_agree_with_the_probe() {
        // Runs on hosts with and without a GPU: whatever the probe says, auto and cuda agree.
        let auto = select_backend(BackendKind::Auto, &[]).unwrap();
        match select_backend(BackendKind::Cuda, &[]) {
            Ok(c) => assert_eq!((c, auto), (BackendChoice::Cuda, BackendChoice::Cuda)),
            Err(e) => {
                assert!(matches!(
                    e,
                    CudaError::NoDriver | CudaError::NoDevice { .. }
                ));
                assert_eq!(auto, BackendChoice::Cpu);
            }
        }
    }

    #[test]
    fn a_missing_ordinal_is_a_typed_error() {
        match select_backend(BackendKind::Cuda, &[4096]) {
            Err(CudaError::NoDriver) | Err(CudaError::NoDevice { .. }) => {}
            other => panic!("expected NoDriver/NoDevice, got {other:?}"),
        }
    }
}
