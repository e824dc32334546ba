pub mod mock_worker;
