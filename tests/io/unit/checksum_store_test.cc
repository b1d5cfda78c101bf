// The checksumming wrapper: reads are checked against what was written, corruption below it (on
// disk or on the way back) is a DataLoss naming the file and offset, and nothing else changes.
#include "io/checksum_store.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "io/fault_injection.h"
#include "io/memory_store.h"
#include "test_support.h"

namespace strata::io {
namespace {

using ::testing::HasSubstr;

struct Aligned {
  explicit Aligned(size_t n) : size(n), data(static_cast<std::byte*>(std::aligned_alloc(4096, n))) {}
  ~Aligned() { std::free(data); }
  void Fill(uint8_t seed) {
    for (size_t i = 0; i < size; ++i) data[i] = static_cast<std::byte>((i * 31 + seed) & 0xff);
  }
  size_t size;
  std::byte* data;
};

class ChecksumStoreTest : public ::testing::Test {
 protected:
  // memory store <- fault injection <- checksums
  void SetUp() override {
    faults_ = std::make_shared<FaultInjector>();
    auto inner = CreateMemoryStore({});
    ASSERT_TRUE(inner.ok());
    store_ = CreateChecksummingStore(CreateFaultInjectingStore(std::move(inner).value(), faults_));
    FileSpec spec;
    spec.paths = {"/mem/optim.swap"};
    spec.direct = DirectMode::kOff;
    auto id = store_->Open(spec);
    ASSERT_TRUE(id.ok()) << id.status().ToString();
    file_ = *id;
  }
  std::shared_ptr<FaultInjector> faults_;
  std::unique_ptr<BlockStore> store_;
  FileId file_ = 0;
};

TEST_F(ChecksumStoreTest, ReadsOfWrittenRangesAreVerified) {
  Aligned a(16384), b(16384);
  a.Fill(7);
  ASSERT_TRUE(store_->Write(file_, 8192, a.size, a.data).ok());
  ASSERT_TRUE(store_->Read(file_, 8192, b.size, b.data).ok());
  EXPECT_EQ(std::memcmp(a.data, b.data, a.size), 0);
  const StoreStats s = store_->stats();
  EXPECT_EQ(s.checksum_verified_reads, 1u);
  EXPECT_EQ(s.checksum_mismatches, 0u);
  EXPECT_EQ(s.checksum_bytes, 2u * a.size);
  EXPECT_EQ(s.writes, 1u);  // the inner store's counters come through
  EXPECT_EQ(s.reads, 1u);
}

TEST_F(ChecksumStoreTest, CorruptedReadIsDataLossNamingFileAndOffset) {
  Aligned a(16384), b(16384);
  a.Fill(3);
  ASSERT_TRUE(store_->Write(file_, 4096, a.size, a.data).ok());
  FaultRule corrupt;
  corrupt.kind = FaultKind::kCorrupt;
  corrupt.max_hits = 1;
  faults_->AddRule(corrupt);
  Status st = store_->Read(file_, 4096, b.size, b.data);
  ASSERT_EQ(st.code(), StatusCode::kDataLoss) << st.ToString();
  EXPECT_THAT(st.message(), HasSubstr("checksum mismatch reading /mem/optim.swap at offset 4096"));
  EXPECT_THAT(st.message(), HasSubstr("16384 bytes"));
  EXPECT_EQ(store_->stats().checksum_mismatches, 1u);
  // The bytes themselves are intact: the next read (no fault) verifies.
  ASSERT_TRUE(store_->Read(file_, 4096, b.size, b.data).ok());
  EXPECT_EQ(std::memcmp(a.data, b.data, a.size), 0);
}

TEST(ChecksumStoreFaults, WithoutChecksumsTheSameCorruptionIsSilent) {
  // What the wrapper is for: the same fault under a bare store completes OK with wrong bytes.
  auto faults = std::make_shared<FaultInjector>();
  auto inner = CreateMemoryStore({});
  ASSERT_TRUE(inner.ok());
  auto store = CreateFaultInjectingStore(std::move(inner).value(), faults);
  FileSpec spec;
  spec.paths = {"/mem/x"};
  spec.direct = DirectMode::kOff;
  auto id = store->Open(spec);
  ASSERT_TRUE(id.ok());
  Aligned a(8192), b(8192);
  a.Fill(1);
  ASSERT_TRUE(store->Write(*id, 0, a.size, a.data).ok());
  FaultRule corrupt;
  corrupt.kind = FaultKind::kCorrupt;
  faults->AddRule(corrupt);
  ASSERT_TRUE(store->Read(*id, 0, b.size, b.data).ok());
  EXPECT_NE(std::memcmp(a.data, b.data, a.size), 0);
}

TEST_F(ChecksumStoreTest, RangesNotWrittenAsReadAreNotChecked) {
  Aligned a(16384), b(8192);
  a.Fill(5);
  ASSERT_TRUE(store_->Write(file_, 0, a.size, a.data).ok());
  // A part of a written range: no checksum for it, passed through and counted.
  ASSERT_TRUE(store_->Read(file_, 0, b.size, b.data).ok());
  EXPECT_EQ(store_->stats().checksum_unverified_reads, 1u);
  // A later write over part of the range drops the old checksum: the whole range is unknown.
  ASSERT_TRUE(store_->Write(file_, 8192, b.size, b.data).ok());
  ASSERT_TRUE(store_->Read(file_, 0, a.size, a.data).ok());
  EXPECT_EQ(store_->stats().checksum_unverified_reads, 2u);
  EXPECT_EQ(store_->stats().checksum_verified_reads, 0u);
  // ... but the range just written is known.
  ASSERT_TRUE(store_->Read(file_, 8192, b.size, b.data).ok());
  EXPECT_EQ(store_->stats().checksum_verified_reads, 1u);
}

TEST_F(ChecksumStoreTest, AFailedWriteForgetsTheRange) {
  Aligned a(8192), b(8192);
  a.Fill(9);
  ASSERT_TRUE(store_->Write(file_, 0, a.size, a.data).ok());
  FaultRule eio;
  eio.op = IoOp::kWrite;
  eio.max_hits = 1;
  faults_->AddRule(eio);
  a.Fill(10);
  ASSERT_FALSE(store_->Write(file_, 0, a.size, a.data).ok());
  // The old checksum no longer describes the bytes there: the read is not checked against it.
  ASSERT_TRUE(store_->Read(file_, 0, b.size, b.data).ok());
  EXPECT_EQ(store_->stats().checksum_mismatches, 0u);
  EXPECT_EQ(store_->stats().checksum_unverified_reads, 1u);
}

TEST(ChecksumStoreFiles, BytesChangedOnDiskAreCaught) {
  // A real file (posix backend): another writer changes 1 KiB between our write and our read,
  // the way the bug this guards against was found.
  strata::testing::TempDir dir;
  StoreOptions options;
  options.backend = Backend::kPosix;
  auto inner = CreateBlockStore(options);
  ASSERT_TRUE(inner.ok()) << inner.status().ToString();
  auto store = CreateChecksummingStore(std::move(inner).value());
  FileSpec spec;
  spec.paths = {dir.file("strata.rank0.optim.swap")};
  auto id = store->Open(spec);
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  Aligned a(65536), b(65536);
  a.Fill(2);
  ASSERT_TRUE(store->Write(*id, 0, a.size, a.data).ok());
  ASSERT_TRUE(store->Read(*id, 0, b.size, b.data).ok());
  const int fd = ::open(spec.paths[0].c_str(), O_WRONLY);
  ASSERT_GE(fd, 0);
  std::vector<char> junk(1024, 'x');
  ASSERT_EQ(::pwrite(fd, junk.data(), junk.size(), 20000), 1024);
  ASSERT_EQ(::fsync(fd), 0);
  ::close(fd);
  Status st = store->Read(*id, 0, b.size, b.data);
  ASSERT_EQ(st.code(), StatusCode::kDataLoss) << st.ToString();
  EXPECT_THAT(st.message(), HasSubstr(spec.paths[0]));
  EXPECT_THAT(st.message(), HasSubstr("at offset 0"));
  EXPECT_TRUE(store->Close(*id).ok());
}

TEST(ChecksumTest, IsXxh3AndSensitiveToEveryByte) {
  std::vector<std::byte> v(4096, std::byte{0});
  const uint64_t h0 = Checksum64(v);
  EXPECT_EQ(h0, Checksum64(v));
  for (size_t i : {size_t{0}, size_t{1000}, size_t{4095}}) {
    v[i] = std::byte{1};
    EXPECT_NE(Checksum64(v), h0) << i;
    v[i] = std::byte{0};
  }
  // XXH3-64 of the empty input (its published test vector).
  EXPECT_EQ(Checksum64({}), 0x2D06800538D394C2ull);
}

}  // namespace
}  // namespace strata::io
