// The launcher's environment: ParseLaunch over a fake environment, DetectLaunch over the real one.
#include "comm/launch.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "comm/comm_test_util.h"
#include "strata/collective.h"

namespace strata::comm {
namespace {

using internal::ParseLaunch;
using ::testing::HasSubstr;
using testing::EnvGuard;

// A fake environment for ParseLaunch.
class FakeEnv {
 public:
  explicit FakeEnv(std::map<std::string, std::string> vars) : vars_(std::move(vars)) {}
  internal::GetEnvFn fn() const {
    return [this](const char* name) -> const char* {
      auto it = vars_.find(name);
      return it == vars_.end() ? nullptr : it->second.c_str();
    };
  }

 private:
  std::map<std::string, std::string> vars_;
};

TEST(ParseLaunchTest, NothingSetIsOneProcess) {
  FakeEnv env({});
  ASSERT_OK_AND_ASSIGN(LaunchInfo info, ParseLaunch(env.fn()));
  EXPECT_EQ(info.rank, 0);
  EXPECT_EQ(info.world_size, 1);
  EXPECT_EQ(info.local_rank, 0);
  EXPECT_EQ(info.launcher, "none");
}

TEST(ParseLaunchTest, OpenMpi) {
  FakeEnv env({{"OMPI_COMM_WORLD_RANK", "3"},
               {"OMPI_COMM_WORLD_SIZE", "8"},
               {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}});
  ASSERT_OK_AND_ASSIGN(LaunchInfo info, ParseLaunch(env.fn()));
  EXPECT_EQ(info.rank, 3);
  EXPECT_EQ(info.world_size, 8);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_size, 8);  // not said: every rank is assumed on this node
  EXPECT_EQ(info.launcher, "mpirun");
}

TEST(ParseLaunchTest, RanksPerNode) {
  FakeEnv ompi({{"OMPI_COMM_WORLD_RANK", "3"},
                {"OMPI_COMM_WORLD_SIZE", "8"},
                {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  ASSERT_OK_AND_ASSIGN(LaunchInfo info, ParseLaunch(ompi.fn()));
  EXPECT_EQ(info.local_size, 2);
  FakeEnv pmi({{"PMI_RANK", "2"}, {"PMI_SIZE", "4"}, {"MPI_LOCALNRANKS", "4"}});
  ASSERT_OK_AND_ASSIGN(info, ParseLaunch(pmi.fn()));
  EXPECT_EQ(info.local_size, 4);
  FakeEnv slurm({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "16"}, {"SLURM_NTASKS_PER_NODE", "4"}});
  ASSERT_OK_AND_ASSIGN(info, ParseLaunch(slurm.fn()));
  EXPECT_EQ(info.local_size, 4);
  // A local rank at or past the node's size, or a node larger than the world, is refused.
  FakeEnv past({{"OMPI_COMM_WORLD_RANK", "3"},
                {"OMPI_COMM_WORLD_SIZE", "8"},
                {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
                {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  EXPECT_THAT(ParseLaunch(past.fn()).status().message(), HasSubstr("OMPI_COMM_WORLD_LOCAL_SIZE=2"));
  FakeEnv big({{"PMI_RANK", "0"}, {"PMI_SIZE", "2"}, {"MPI_LOCALNRANKS", "3"}});
  EXPECT_THAT(ParseLaunch(big.fn()).status().message(), HasSubstr("MPI_LOCALNRANKS=3"));
}

TEST(ParseLaunchTest, Pmi) {
  FakeEnv env({{"PMI_RANK", "2"}, {"PMI_SIZE", "4"}, {"MPI_LOCALRANKID", "0"}});
  ASSERT_OK_AND_ASSIGN(LaunchInfo info, ParseLaunch(env.fn()));
  EXPECT_EQ(info.rank, 2);
  EXPECT_EQ(info.world_size, 4);
  EXPECT_EQ(info.local_rank, 0);
  EXPECT_EQ(info.launcher, "pmi");
}

TEST(ParseLaunchTest, SlurmPrefersTheStepSize) {
  FakeEnv with_step({{"SLURM_PROCID", "5"},
                     {"SLURM_NTASKS", "16"},
                     {"SLURM_STEP_NUM_TASKS", "8"},
                     {"SLURM_LOCALID", "1"}});
  ASSERT_OK_AND_ASSIGN(LaunchInfo info, ParseLaunch(with_step.fn()));
  EXPECT_EQ(info.rank, 5);
  EXPECT_EQ(info.world_size, 8);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.launcher, "srun");

  FakeEnv job_only({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "16"}});
  ASSERT_OK_AND_ASSIGN(info, ParseLaunch(job_only.fn()));
  EXPECT_EQ(info.world_size, 16);
  EXPECT_EQ(info.local_rank, 0);
}

TEST(ParseLaunchTest, OpenMpiWinsOverSlurm) {
  // mpirun inside a Slurm allocation: both sets of variables are present.
  FakeEnv env({{"SLURM_PROCID", "0"},
               {"SLURM_NTASKS", "1"},
               {"OMPI_COMM_WORLD_RANK", "1"},
               {"OMPI_COMM_WORLD_SIZE", "2"}});
  ASSERT_OK_AND_ASSIGN(LaunchInfo info, ParseLaunch(env.fn()));
  EXPECT_EQ(info.launcher, "mpirun");
  EXPECT_EQ(info.rank, 1);
  EXPECT_EQ(info.world_size, 2);
}

TEST(ParseLaunchTest, MalformedValuesNameTheVariable) {
  struct Case {
    std::map<std::string, std::string> vars;
    std::string expected;  // in the message
  };
  const Case cases[] = {
      {{{"OMPI_COMM_WORLD_RANK", "one"}, {"OMPI_COMM_WORLD_SIZE", "2"}},
       "OMPI_COMM_WORLD_RANK='one'"},
      {{{"OMPI_COMM_WORLD_RANK", "-1"}, {"OMPI_COMM_WORLD_SIZE", "2"}},
       "OMPI_COMM_WORLD_RANK='-1'"},
      {{{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2x"}},
       "OMPI_COMM_WORLD_SIZE='2x'"},
      {{{"OMPI_COMM_WORLD_RANK", "1"}}, "OMPI_COMM_WORLD_SIZE is unset"},
      {{{"PMI_RANK", "0"}, {"PMI_SIZE", "0"}}, "PMI_SIZE is 0"},
      {{{"PMI_RANK", "4"}, {"PMI_SIZE", "4"}}, "PMI_RANK=4 is not below PMI_SIZE=4"},
      {{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "2"}},
       "SLURM_LOCALID=2 is not below SLURM_NTASKS=2"},
      {{{"SLURM_PROCID", ""}, {"SLURM_NTASKS", "2"}}, "SLURM_PROCID=''"},
  };
  for (const Case& c : cases) {
    FakeEnv env(c.vars);
    Result<LaunchInfo> info = ParseLaunch(env.fn());
    ASSERT_FALSE(info.ok()) << c.expected;
    EXPECT_EQ(info.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(info.status().message().find(c.expected), std::string_view::npos)
        << info.status().ToString();
  }
}

TEST(DetectLaunchTest, ReadsTheProcessEnvironment) {
  EnvGuard env;
  env.ClearLauncher();
  EXPECT_EQ(DetectLaunch().launcher, "none");
  EXPECT_EQ(DetectLaunch().world_size, 1);

  env.Set("SLURM_PROCID", "3");
  env.Set("SLURM_NTASKS", "4");
  env.Set("SLURM_LOCALID", "3");
  LaunchInfo info = DetectLaunch();
  EXPECT_EQ(info.launcher, "srun");
  EXPECT_EQ(info.rank, 3);
  EXPECT_EQ(info.world_size, 4);
  EXPECT_EQ(info.local_rank, 3);
}

TEST(DetectLaunchTest, MalformedEnvironmentFallsBackToOneProcess) {
  EnvGuard env;
  env.ClearLauncher();
  env.Set("PMI_RANK", "zero");
  env.Set("PMI_SIZE", "2");
  LaunchInfo info = DetectLaunch();
  EXPECT_EQ(info.launcher, "none");
  EXPECT_EQ(info.rank, 0);
  EXPECT_EQ(info.world_size, 1);
}

}  // namespace
}  // namespace strata::comm
